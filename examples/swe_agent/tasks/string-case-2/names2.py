def caps(s):
    return s.lower()
