def keep_even(xs):
    return [x for x in xs if x % 2 == 1]
