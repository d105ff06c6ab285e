import unittest

from fizz1 import label


class Fizz1Test(unittest.TestCase):
    def test_both(self):
        self.assertEqual(label(14), 'FizzBuzz')

    def test_a(self):
        self.assertEqual(label(2), 'Fizz')

    def test_plain(self):
        self.assertEqual(label(1), '1')
