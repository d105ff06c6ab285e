import unittest

from words0 import is_palindrome


class Words0Test(unittest.TestCase):
    def test_yes(self):
        self.assertTrue(is_palindrome('Level'))

    def test_no(self):
        self.assertFalse(is_palindrome('python'))

    def test_empty(self):
        self.assertTrue(is_palindrome(''))
