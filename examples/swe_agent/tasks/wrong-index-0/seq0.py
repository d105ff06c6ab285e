def last(items):
    return items[len(items) - 2]
