import unittest

from series2 import triangle


class Series2Test(unittest.TestCase):
    def test_three(self):
        self.assertEqual(triangle(3), 6)

    def test_one(self):
        self.assertEqual(triangle(1), 1)

    def test_zero(self):
        self.assertEqual(triangle(0), 0)
