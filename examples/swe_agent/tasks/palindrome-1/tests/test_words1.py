import unittest

from words1 import reads_same


class Words1Test(unittest.TestCase):
    def test_yes(self):
        self.assertTrue(reads_same('Level'))

    def test_no(self):
        self.assertFalse(reads_same('python'))

    def test_empty(self):
        self.assertTrue(reads_same(''))
