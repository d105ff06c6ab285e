import unittest

from words2 import mirror


class Words2Test(unittest.TestCase):
    def test_yes(self):
        self.assertTrue(mirror('Level'))

    def test_no(self):
        self.assertFalse(mirror('python'))

    def test_empty(self):
        self.assertTrue(mirror(''))
