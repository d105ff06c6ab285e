import unittest

from bounds1 import clamp


class Bounds1Test(unittest.TestCase):
    def test_above(self):
        self.assertEqual(clamp(105), 100)

    def test_below(self):
        self.assertEqual(clamp(-3), 0)

    def test_inside(self):
        self.assertEqual(clamp(7), 7)
