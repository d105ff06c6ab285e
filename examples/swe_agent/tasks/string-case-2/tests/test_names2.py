import unittest

from names2 import caps


class Names2Test(unittest.TestCase):
    def test_word(self):
        self.assertEqual(caps('abc'), 'ABC')

    def test_mixed(self):
        self.assertEqual(caps('aB'), 'AB')

    def test_empty(self):
        self.assertEqual(caps(''), '')
