import unittest

from numbers0 import mean


class Numbers0Test(unittest.TestCase):
    def test_half(self):
        self.assertEqual(mean([1, 2]), 1.5)

    def test_whole(self):
        self.assertEqual(mean([2, 4]), 3)

    def test_one(self):
        self.assertEqual(mean([5]), 5)
