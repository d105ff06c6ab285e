import unittest

from seq0 import last


class Seq0Test(unittest.TestCase):
    def test_three(self):
        self.assertEqual(last([1, 2, 3]), 3)

    def test_one(self):
        self.assertEqual(last(['x']), 'x')

    def test_two(self):
        self.assertEqual(last([4, 5]), 5)
