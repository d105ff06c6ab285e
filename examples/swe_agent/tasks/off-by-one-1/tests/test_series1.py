import unittest

from series1 import series


class Series1Test(unittest.TestCase):
    def test_three(self):
        self.assertEqual(series(3), 6)

    def test_one(self):
        self.assertEqual(series(1), 1)

    def test_zero(self):
        self.assertEqual(series(0), 0)
