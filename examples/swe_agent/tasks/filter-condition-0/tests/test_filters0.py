import unittest

from filters0 import evens


class Filters0Test(unittest.TestCase):
    def test_mixed(self):
        self.assertEqual(evens([1, 2, 3, 4]), [2, 4])

    def test_none(self):
        self.assertEqual(evens([1, 3]), [])

    def test_zero(self):
        self.assertEqual(evens([0]), [0])
