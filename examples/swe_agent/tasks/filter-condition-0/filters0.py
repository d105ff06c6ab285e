def evens(xs):
    return [x for x in xs if x % 2 == 1]
