import unittest

from filters2 import keep_even


class Filters2Test(unittest.TestCase):
    def test_mixed(self):
        self.assertEqual(keep_even([1, 2, 3, 4]), [2, 4])

    def test_none(self):
        self.assertEqual(keep_even([1, 3]), [])

    def test_zero(self):
        self.assertEqual(keep_even([0]), [0])
