def is_palindrome(text):
    t = text.lower()
    return t == t
