import unittest

from stats2 import top


class Stats2Test(unittest.TestCase):
    def test_negative(self):
        self.assertEqual(top([-5, -2, -9]), -2)

    def test_mixed(self):
        self.assertEqual(top([1, 7, 3]), 7)

    def test_single(self):
        self.assertEqual(top([4]), 4)
