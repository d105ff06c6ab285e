import unittest

from fizz2 import label


class Fizz2Test(unittest.TestCase):
    def test_both(self):
        self.assertEqual(label(24), 'FizzBuzz')

    def test_a(self):
        self.assertEqual(label(4), 'Fizz')

    def test_plain(self):
        self.assertEqual(label(1), '1')
