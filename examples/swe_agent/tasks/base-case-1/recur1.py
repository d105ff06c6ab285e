def fact(n):
    if n == 0:
        return 0
    return n * fact(n - 1)
