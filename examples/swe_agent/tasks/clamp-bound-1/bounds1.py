def clamp(x):
    if x < 0:
        return 0
    if x > 100:
        return 99
    return x
