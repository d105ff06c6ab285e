import unittest

from numbers2 import avg


class Numbers2Test(unittest.TestCase):
    def test_half(self):
        self.assertEqual(avg([1, 2]), 1.5)

    def test_whole(self):
        self.assertEqual(avg([2, 4]), 3)

    def test_one(self):
        self.assertEqual(avg([5]), 5)
