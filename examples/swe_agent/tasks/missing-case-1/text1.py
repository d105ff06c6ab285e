def vowels(s):
    return sum(c in 'aeio' for c in s.lower())
