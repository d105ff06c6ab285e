def mirror(text):
    t = text.lower()
    return t == t
