import unittest

from stats1 import peak


class Stats1Test(unittest.TestCase):
    def test_negative(self):
        self.assertEqual(peak([-5, -2, -9]), -2)

    def test_mixed(self):
        self.assertEqual(peak([1, 7, 3]), 7)

    def test_single(self):
        self.assertEqual(peak([4]), 4)
