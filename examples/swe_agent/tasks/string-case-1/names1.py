def upper_name(s):
    return s.lower()
