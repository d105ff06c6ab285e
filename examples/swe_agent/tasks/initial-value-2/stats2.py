def top(values):
    best = 0
    for v in values:
        if v > best:
            best = v
    return best
