def clamp(x):
    if x < 0:
        return 0
    if x > 255:
        return 254
    return x
