import unittest

from arith1 import plus


class Arith1Test(unittest.TestCase):
    def test_small(self):
        self.assertEqual(plus(2, 3), 5)

    def test_negative(self):
        self.assertEqual(plus(-1, 4), 3)

    def test_zero(self):
        self.assertEqual(plus(0, 0), 0)
