import unittest

from fizz0 import label


class Fizz0Test(unittest.TestCase):
    def test_both(self):
        self.assertEqual(label(15), 'FizzBuzz')

    def test_a(self):
        self.assertEqual(label(3), 'Fizz')

    def test_plain(self):
        self.assertEqual(label(1), '1')
