import unittest

from bounds0 import clamp


class Bounds0Test(unittest.TestCase):
    def test_above(self):
        self.assertEqual(clamp(15), 10)

    def test_below(self):
        self.assertEqual(clamp(-3), 0)

    def test_inside(self):
        self.assertEqual(clamp(7), 7)
