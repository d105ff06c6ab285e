import unittest

from series0 import sum_to


class Series0Test(unittest.TestCase):
    def test_three(self):
        self.assertEqual(sum_to(3), 6)

    def test_one(self):
        self.assertEqual(sum_to(1), 1)

    def test_zero(self):
        self.assertEqual(sum_to(0), 0)
