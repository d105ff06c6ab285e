import unittest

from recur2 import product_to


class Recur2Test(unittest.TestCase):
    def test_zero(self):
        self.assertEqual(product_to(0), 1)

    def test_four(self):
        self.assertEqual(product_to(4), 24)

    def test_one(self):
        self.assertEqual(product_to(1), 1)
