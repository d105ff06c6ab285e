import unittest

from text0 import count_vowels


class Text0Test(unittest.TestCase):
    def test_u(self):
        self.assertEqual(count_vowels('sun'), 1)

    def test_mixed(self):
        self.assertEqual(count_vowels('Education'), 5)

    def test_none(self):
        self.assertEqual(count_vowels('rhythm'), 0)
