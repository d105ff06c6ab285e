import unittest

from recur1 import fact


class Recur1Test(unittest.TestCase):
    def test_zero(self):
        self.assertEqual(fact(0), 1)

    def test_four(self):
        self.assertEqual(fact(4), 24)

    def test_one(self):
        self.assertEqual(fact(1), 1)
