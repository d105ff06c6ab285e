def avg(values):
    return sum(values) // len(values)
