import unittest

from seq1 import final


class Seq1Test(unittest.TestCase):
    def test_three(self):
        self.assertEqual(final([1, 2, 3]), 3)

    def test_one(self):
        self.assertEqual(final(['x']), 'x')

    def test_two(self):
        self.assertEqual(final([4, 5]), 5)
