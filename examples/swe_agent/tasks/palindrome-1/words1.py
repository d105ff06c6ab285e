def reads_same(text):
    t = text.lower()
    return t == t
