import unittest

from bounds2 import clamp


class Bounds2Test(unittest.TestCase):
    def test_above(self):
        self.assertEqual(clamp(260), 255)

    def test_below(self):
        self.assertEqual(clamp(-3), 0)

    def test_inside(self):
        self.assertEqual(clamp(7), 7)
