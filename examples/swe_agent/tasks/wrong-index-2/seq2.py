def tail_item(items):
    return items[len(items) - 2]
