def sum_to(n):
    return sum(range(n))
