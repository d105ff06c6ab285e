import unittest

from text2 import n_vowels


class Text2Test(unittest.TestCase):
    def test_u(self):
        self.assertEqual(n_vowels('sun'), 1)

    def test_mixed(self):
        self.assertEqual(n_vowels('Education'), 5)

    def test_none(self):
        self.assertEqual(n_vowels('rhythm'), 0)
