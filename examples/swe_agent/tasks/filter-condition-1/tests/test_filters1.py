import unittest

from filters1 import even_only


class Filters1Test(unittest.TestCase):
    def test_mixed(self):
        self.assertEqual(even_only([1, 2, 3, 4]), [2, 4])

    def test_none(self):
        self.assertEqual(even_only([1, 3]), [])

    def test_zero(self):
        self.assertEqual(even_only([0]), [0])
