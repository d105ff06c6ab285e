"""The radix tree of the prefix cache on its own: matching splits edges, held prefixes survive
eviction, eviction is least recently used first, a reset forgets holds."""

from __future__ import annotations

import torch
from miles_engine.radix_tree import RadixTree


def _rows(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count)


def test_match_returns_the_longest_cached_prefix_and_its_rows() -> None:
    tree = RadixTree()
    leaf = tree.extend(tree.root, [1, 2, 3, 4], _rows(0, 4))
    tree.extend(leaf, [5, 6], _rows(4, 2))
    assert tree.peek([1, 2, 3, 4, 5, 6, 7]) == 6
    assert tree.peek([1, 2, 9]) == 2 and tree.peek([9]) == 0
    match = tree.match([1, 2, 9])  # ends inside the first edge: it is split there
    assert match.length == 2 and torch.cat(match.rows).tolist() == [0, 1]
    assert match.node.key == [1, 2] and list(match.node.children) == [3]
    full = tree.match([1, 2, 3, 4, 5, 6, 7])
    assert full.length == 6 and torch.cat(full.rows).tolist() == [0, 1, 2, 3, 4, 5]
    assert tree.tokens == 6


def test_held_prefixes_are_never_evicted_and_leaves_go_least_recently_used_first() -> None:
    tree = RadixTree()
    shared = tree.extend(tree.root, [1, 2], _rows(0, 2))
    tree.extend(shared, [3], _rows(2, 1))  # the leaf used first
    new = tree.extend(shared, [4], _rows(3, 1))
    other = tree.extend(tree.root, [7, 7, 7], _rows(4, 3))
    tree.hold(other)
    tree.match([1, 2, 4])  # touches `new` (and `shared`) after `old`
    freed = tree.evict(1)
    assert [r.tolist() for r in freed] == [[2]]  # `old`: the least recently used free leaf
    assert tree.peek([1, 2, 3]) == 2 and tree.peek([1, 2, 4]) == 3
    freed = tree.evict(100)  # everything that is not held
    assert sorted(torch.cat(freed).tolist()) == [0, 1, 3]
    assert tree.peek([7, 7, 7]) == 3 and tree.tokens == 3 and tree.pinned_tokens == 3
    tree.release(other)
    assert tree.pinned_tokens == 0 and torch.cat(tree.evict(3)).tolist() == [4, 5, 6]
    assert new.parent is shared  # detached nodes keep their links; the tree no longer reaches them


def test_a_split_keeps_the_holds_of_the_node_it_cuts() -> None:
    tree = RadixTree()
    leaf = tree.extend(tree.root, [1, 2, 3, 4], _rows(0, 4))
    tree.hold(leaf)
    tree.match([1, 2])  # splits the held edge: the upper half is on the held path too
    assert tree.evict(10) == [] and tree.pinned_tokens == 4
    tree.release(leaf)
    assert tree.pinned_tokens == 0 and len(torch.cat(tree.evict(10))) == 4


def test_a_reset_forgets_everything_and_later_releases_of_old_nodes_do_nothing() -> None:
    tree = RadixTree()
    leaf = tree.extend(tree.root, [1, 2], _rows(0, 2))
    tree.hold(leaf)
    tree.reset()
    assert tree.tokens == 0 and tree.peek([1, 2]) == 0
    tree.release(leaf)  # held before the reset: nothing to undo
    fresh = tree.extend(tree.root, [1, 2], _rows(0, 2))
    tree.hold(fresh)
    tree.release(leaf)
    assert tree.pinned_tokens == 2
