import unittest

from names0 import shout


class Names0Test(unittest.TestCase):
    def test_word(self):
        self.assertEqual(shout('abc'), 'ABC')

    def test_mixed(self):
        self.assertEqual(shout('aB'), 'AB')

    def test_empty(self):
        self.assertEqual(shout(''), '')
