import unittest

from arith2 import total


class Arith2Test(unittest.TestCase):
    def test_small(self):
        self.assertEqual(total(2, 3), 5)

    def test_negative(self):
        self.assertEqual(total(-1, 4), 3)

    def test_zero(self):
        self.assertEqual(total(0, 0), 0)
