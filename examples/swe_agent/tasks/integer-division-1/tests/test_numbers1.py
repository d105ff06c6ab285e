import unittest

from numbers1 import average


class Numbers1Test(unittest.TestCase):
    def test_half(self):
        self.assertEqual(average([1, 2]), 1.5)

    def test_whole(self):
        self.assertEqual(average([2, 4]), 3)

    def test_one(self):
        self.assertEqual(average([5]), 5)
