def total(a, b):
    return a - b
