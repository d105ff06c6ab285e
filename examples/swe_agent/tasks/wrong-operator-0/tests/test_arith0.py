import unittest

from arith0 import add


class Arith0Test(unittest.TestCase):
    def test_small(self):
        self.assertEqual(add(2, 3), 5)

    def test_negative(self):
        self.assertEqual(add(-1, 4), 3)

    def test_zero(self):
        self.assertEqual(add(0, 0), 0)
