import unittest

from seq2 import tail_item


class Seq2Test(unittest.TestCase):
    def test_three(self):
        self.assertEqual(tail_item([1, 2, 3]), 3)

    def test_one(self):
        self.assertEqual(tail_item(['x']), 'x')

    def test_two(self):
        self.assertEqual(tail_item([4, 5]), 5)
