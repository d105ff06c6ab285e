import unittest

from text1 import vowels


class Text1Test(unittest.TestCase):
    def test_u(self):
        self.assertEqual(vowels('sun'), 1)

    def test_mixed(self):
        self.assertEqual(vowels('Education'), 5)

    def test_none(self):
        self.assertEqual(vowels('rhythm'), 0)
