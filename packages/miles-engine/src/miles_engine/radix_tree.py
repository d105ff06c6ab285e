"""A radix tree over token ids: which prefixes have KV rows in the prefix pool, and where.

Each edge holds a run of tokens (``key``) and, position for position, the pool rows that hold
their keys and values (``rows``, a 1-D index tensor of the same length). A path from the root
spells a cached prefix; its rows, concatenated, are that prefix's KV in the pool.

Reference counts pin nodes: a running request holds the deepest node of the prefix it was given
(or stored), and every node on the path to the root counts it. Only leaves nobody holds are
evicted, least recently used first (a match or an insert touches the nodes it walks), so a
prefix that some running request builds on never disappears under it.

The tree knows nothing of tensors' contents: it hands freed rows back to its caller, which owns
the pool (:mod:`miles_engine.prefix_cache`). Everything here runs on the scheduler thread.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(eq=False, slots=True)
class RadixNode:
    key: list[int]
    rows: torch.Tensor | None  # [len(key)] pool rows; None at the root
    parent: RadixNode | None
    children: dict[int, RadixNode] = field(default_factory=dict)  # first token of the child's key -> child
    refs: int = 0  # running requests whose held prefix passes through this node
    last_used: int = 0


@dataclass(slots=True)
class Match:
    node: RadixNode  # the deepest node of the match; its path spells exactly ``length`` tokens
    length: int
    rows: list[torch.Tensor]  # pool rows of the matched tokens, edge by edge


class RadixTree:
    def __init__(self) -> None:
        self.root = RadixNode(key=[], rows=None, parent=None)
        self.tokens = 0  # tokens held by the tree (= pool rows in use)
        self._clock = itertools.count(1)

    def reset(self) -> None:
        """Forget everything (the caller frees the pool's rows wholesale)."""
        self.root = RadixNode(key=[], rows=None, parent=None)
        self.tokens = 0

    def peek(self, ids: list[int]) -> int:
        """How many leading tokens of ``ids`` are cached (no node is split, touched or pinned)."""
        node, matched = self.root, 0
        while matched < len(ids):
            child = node.children.get(ids[matched])
            if child is None:
                break
            common = _common_length(child.key, ids, matched)
            matched += common
            if common < len(child.key):
                break
            node = child
        return matched

    def match(self, ids: list[int]) -> Match:
        """The longest cached prefix of ``ids``; splits the last edge so that the match ends on a
        node, and marks the path used."""
        now = next(self._clock)
        node, matched, rows = self.root, 0, []
        while matched < len(ids):
            child = node.children.get(ids[matched])
            if child is None:
                break
            common = _common_length(child.key, ids, matched)
            if common < len(child.key):
                child = self._split(child, common)
            assert child.rows is not None  # only the root has no rows
            child.last_used = now
            rows.append(child.rows)
            matched += common
            node = child
        return Match(node=node, length=matched, rows=rows)

    def extend(self, node: RadixNode, key: list[int], rows: torch.Tensor) -> RadixNode:
        """Add ``key`` (with its pool ``rows``) under ``node``, which must end a match and have no
        child starting with ``key[0]``; returns the new leaf."""
        assert key and key[0] not in node.children and len(key) == rows.shape[0]
        leaf = RadixNode(key=list(key), rows=rows, parent=node, last_used=next(self._clock))
        node.children[key[0]] = leaf
        self.tokens += len(key)
        return leaf

    def hold(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors against eviction (one more running request uses them)."""
        walk: RadixNode | None = node
        while walk is not None:
            walk.refs += 1
            walk = walk.parent

    def release(self, node: RadixNode) -> None:
        """Undo one :meth:`hold` (a no-op for a node dropped by :meth:`reset` meanwhile)."""
        if not self._in_tree(node):
            return
        walk: RadixNode | None = node
        while walk is not None:
            assert walk.refs > 0, "a radix node was released more often than held"
            walk.refs -= 1
            walk = walk.parent

    def evict(self, wanted: int) -> list[torch.Tensor]:
        """Drop unpinned leaves, least recently used first, until ``wanted`` tokens are freed (or
        nothing more can go); returns the freed pool rows."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n.refs == 0]
        heapq.heapify(leaves)
        freed: list[torch.Tensor] = []
        count = 0
        while leaves and count < wanted:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None and leaf.rows is not None  # the root is never a candidate
            del parent.children[leaf.key[0]]
            freed.append(leaf.rows)
            count += len(leaf.key)
            self.tokens -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        return freed

    @property
    def pinned_tokens(self) -> int:
        """Tokens in nodes some running request holds (not evictable now)."""
        return sum(len(n.key) for n in self._nodes() if n.refs > 0)

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut ``child``'s edge after ``at`` tokens; returns the new upper node (``child`` keeps the rest)."""
        assert child.parent is not None and child.rows is not None and 0 < at < len(child.key)
        upper = RadixNode(key=child.key[:at], rows=child.rows[:at], parent=child.parent, refs=child.refs,
                          last_used=child.last_used)
        child.parent.children[upper.key[0]] = upper
        child.key, child.rows, child.parent = child.key[at:], child.rows[at:], upper
        upper.children[child.key[0]] = child
        return upper

    def _in_tree(self, node: RadixNode) -> bool:
        """Whether ``node`` is still part of this tree (not dropped by a reset or an eviction)."""
        while node.parent is not None:
            if node.parent.children.get(node.key[0]) is not node:
                return False
            node = node.parent
        return node is self.root

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _common_length(key: list[int], ids: list[int], start: int) -> int:
    """How many leading tokens of ``key`` equal ``ids[start:]``."""
    if ids[start : start + len(key)] == key:  # the usual case, compared in C
        return len(key)
    limit = min(len(key), len(ids) - start)
    for i in range(limit):
        if key[i] != ids[start + i]:
            return i
    return limit
