import unittest

from stats0 import largest


class Stats0Test(unittest.TestCase):
    def test_negative(self):
        self.assertEqual(largest([-5, -2, -9]), -2)

    def test_mixed(self):
        self.assertEqual(largest([1, 7, 3]), 7)

    def test_single(self):
        self.assertEqual(largest([4]), 4)
