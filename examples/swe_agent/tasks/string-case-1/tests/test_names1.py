import unittest

from names1 import upper_name


class Names1Test(unittest.TestCase):
    def test_word(self):
        self.assertEqual(upper_name('abc'), 'ABC')

    def test_mixed(self):
        self.assertEqual(upper_name('aB'), 'AB')

    def test_empty(self):
        self.assertEqual(upper_name(''), '')
