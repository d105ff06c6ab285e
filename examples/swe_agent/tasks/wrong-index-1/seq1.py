def final(items):
    return items[len(items) - 2]
