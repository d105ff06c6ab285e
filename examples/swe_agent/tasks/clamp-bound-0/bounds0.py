def clamp(x):
    if x < 0:
        return 0
    if x > 10:
        return 9
    return x
