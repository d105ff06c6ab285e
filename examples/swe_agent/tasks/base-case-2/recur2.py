def product_to(n):
    if n == 0:
        return 0
    return n * product_to(n - 1)
