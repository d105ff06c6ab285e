import unittest

from recur0 import factorial


class Recur0Test(unittest.TestCase):
    def test_zero(self):
        self.assertEqual(factorial(0), 1)

    def test_four(self):
        self.assertEqual(factorial(4), 24)

    def test_one(self):
        self.assertEqual(factorial(1), 1)
