"""Prefix-tree training: the rows of a micro-batch that share a prefix see it computed once.

A GRPO group's rows share their prompt; the branches of a compacted or sub-agent episode share
their history. Training them as separate rows runs the shared tokens through every layer once per
row, forward and backward. Here the rows of a micro-batch become a trie over their token ids, laid
out in preorder as one ``[1, N]`` sequence (``N`` = trie nodes <= the rows' total tokens):

* **position ids** are each node's depth (its column in any row through it), so rotary or learned
  positions see exactly what they see in the flat rows;
* **attention**: node ``q`` attends to node ``k`` iff ``k`` is ``q`` or one of its ancestors. In
  preorder a node's subtree is the contiguous run ``[k, subtree_end[k])``, so the mask is
  ``k <= q < subtree_end[k]``: a dense ``[1, 1, N, N]`` boolean mask for ``sdpa``, a block-sparse
  ``BlockMask`` for ``flex_attention`` (the same rule as a ``mask_mod``);
* **log-probs**: entry ``[r, t]`` is predicted from the node of row ``r``'s token ``t - 1``; rows
  that share that node share its hidden state, and its gradient is the sum of theirs, which is
  what the flat rows' backward computes for each copy. Loss and gradients equal the flat rows' (up
  to summation order; tested to 1e-6 relative in fp32).

The trie comes from the token ids alone (no metadata), so it works for any source: rows sorted
lexicographically are a preorder of their trie, and each row shares with all earlier rows exactly
its longest common prefix with the row just before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from miles_algorithms.planning import Key, RankPlan, plan_prefix_micro_batches, tree_load

from miles_fsdp.config import TREE_ATTENTION
from miles_fsdp.packing import ModelInputs

if TYPE_CHECKING:
    from miles_contracts import TrainBatch

TreeMode = Literal["auto", "on", "off"]
TREE_MIN_GAIN = 0.10


@dataclass(frozen=True, slots=True)
class PrefixTree:
    """The trie of a micro-batch's rows, nodes in preorder.

    :ivar tokens: ``[N]`` token id of each node.
    :ivar depth: ``[N]`` depth of each node (0 for a row's first token) = its position id.
    :ivar subtree_end: ``[N]`` node ``k``'s subtree is nodes ``[k, subtree_end[k])``.
    :ivar node_index: ``[b, t]`` node of each real token of the micro-batch, -1 on padding.
    :ivar owner: ``[N]`` flat index ``row * t + col`` of the first row (in preorder) through each node.
    :ivar flat_tokens: real tokens of the rows (what the flat layout computes).
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    subtree_end: torch.Tensor
    node_index: torch.Tensor
    owner: torch.Tensor
    flat_tokens: int

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    def attended_pairs(self) -> int:
        """(query, key) pairs the tree mask allows: every node sees its ``depth + 1`` ancestors and itself."""
        return int(self.depth.sum()) + self.num_nodes

    def dense_mask(self, device: torch.device) -> torch.Tensor:
        """``[1, 1, N, N]`` boolean mask (True = attend) for ``sdpa``."""
        node = torch.arange(self.num_nodes, device=device)
        end = self.subtree_end.to(device)
        query, key = node[:, None], node[None, :]
        return ((key <= query) & (query < end[None, :]))[None, None]

    def block_mask(self, device: torch.device) -> Any:
        """The same mask as a ``flex_attention`` ``BlockMask`` (only blocks with an allowed pair are computed)."""
        from torch.nn.attention.flex_attention import create_block_mask

        end = self.subtree_end.to(device)

        def ancestor_or_self(batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
            return (key <= query) & (query < end[key])

        return create_block_mask(ancestor_or_self, None, None, self.num_nodes, self.num_nodes, device=device)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.numel() else n


def build_prefix_tree(tokens: torch.Tensor, lengths: list[int]) -> PrefixTree:
    """The trie of the rows ``tokens[r, :lengths[r]]`` of a ``[b, t]`` micro-batch (host tensors)."""
    b, t = tokens.shape
    rows = [tokens[r, :n] for r, n in enumerate(lengths)]
    keys = [row.tolist() for row in rows]
    order = sorted(range(b), key=lambda r: keys[r])  # lexicographic = preorder of the trie
    node_index = torch.full((b, t), -1, dtype=torch.long)
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (tokens, depths, owners) per segment
    starts: list[int] = []  # first node of each segment of new nodes
    branch: list[int] = []  # depth at which each segment leaves the nodes before it
    count, previous = 0, None
    for row in order:
        n = lengths[row]
        shared = 0 if previous is None else _common_prefix(rows[previous], rows[row])
        if shared:
            node_index[row, :shared] = node_index[previous, :shared]
        node_index[row, shared:n] = torch.arange(count, count + n - shared)
        if n > shared:  # a duplicate row adds no node
            cols = torch.arange(shared, n)
            pieces.append((rows[row][shared:], cols, row * t + cols))
            starts.append(count)
            branch.append(shared)
            count += n - shared
        previous = row
    if not pieces:
        raise ValueError("a micro-batch needs at least one token to build its prefix tree")
    depth = torch.cat([p[1] for p in pieces])
    return PrefixTree(
        tokens=torch.cat([p[0] for p in pieces]), depth=depth,
        subtree_end=_subtree_ends(starts, branch, [p[1] for p in pieces], count),
        node_index=node_index, owner=torch.cat([p[2] for p in pieces]), flat_tokens=sum(lengths),
    )


def _subtree_ends(starts: list[int], branch: list[int], depths: list[torch.Tensor], total: int) -> torch.Tensor:
    """``[N]`` end of each node's subtree: a node at depth ``d`` of segment ``j`` owns every later
    node up to the first later segment that branches off at depth ``<= d`` (it leaves the path)."""
    ends = []
    branch_t = torch.tensor(branch, dtype=torch.long)
    bounds = torch.tensor([*starts[1:], total], dtype=torch.long)
    for j, segment_depths in enumerate(depths):
        later = branch_t[j + 1 :]
        if later.numel() == 0:
            ends.append(torch.full_like(segment_depths, total))
            continue
        lowest_so_far = torch.cummin(later, dim=0).values  # non-increasing
        # first later segment with branch depth <= d: how many of lowest_so_far are still > d
        first = torch.searchsorted(-lowest_so_far, -segment_depths)
        ends.append(bounds[j:][first])
    return torch.cat(ends)


def tree_inputs(micro: TrainBatch, tree: PrefixTree, *, attention: str, device: torch.device) -> ModelInputs:
    """Model inputs that run ``micro`` (a padded host batch) as its prefix tree: ``[1, N]`` nodes,
    depths as position ids, the tree mask in the form ``attention`` (an HF attention implementation) takes."""
    if bool((micro.loss_mask[:, 0] > 0).any()):
        raise ValueError("loss_mask[:, 0] must be 0: the first token of a row has no context to be predicted from")
    if bool(((micro.loss_mask > 0) & (micro.attention_mask == 0)).any()):
        raise ValueError("loss_mask is non-zero on padding (attention_mask 0); the loss mask must lie inside each row")
    rows, cols = torch.nonzero(micro.loss_mask > 0, as_tuple=True)
    if attention == "flex_attention":
        mask = tree.block_mask(device)
    elif attention == "sdpa":
        mask = tree.dense_mask(device)
    else:
        raise ValueError(f"prefix-tree training needs an attention implementation from {TREE_ATTENTION}, got {attention!r}")

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to(device, non_blocking=True)

    return ModelInputs(
        input_ids=dev(tree.tokens[None, :]), position_ids=dev(tree.depth[None, :]), attention_mask=mask,
        hidden_index=dev(tree.node_index[rows, cols - 1]), target_ids=dev(micro.tokens[rows, cols]),
        rows=dev(rows), cols=dev(cols), shape=(micro.tokens.shape[0], micro.tokens.shape[1]),
        seen_positions=dev(tree.owner),
    )


@dataclass(frozen=True, slots=True)
class TreePolicy:
    """When a micro-batch runs as its prefix tree (``fsdp.prefix_tree``), and with which mask.

    :ivar mode: ``on`` always, ``off`` never, ``auto`` when :meth:`pays` says so.
    :ivar attention: the model's attention implementation (``sdpa``: dense mask; ``flex_attention``: block-sparse).
    :ivar pair_cost: :func:`~miles_fsdp.passes.attention_pair_cost` of the model.
    """

    mode: TreeMode
    attention: str
    pair_cost: float

    @property
    def plans_trees(self) -> bool:
        """Whether micro-batches may run as trees at all (``on``, or ``auto`` with a kernel that takes a mask)."""
        return self.mode == "on" or (self.mode == "auto" and self.attention in TREE_ATTENTION)

    def cost(self, nodes: int, pairs: int) -> float:
        """A tree's cost in the flat layout's units: tokens of matrix multiplies plus attended pairs
        times ``pair_cost``. ``sdpa`` with a mask computes all ``nodes^2`` pairs; ``flex_attention``
        skips empty blocks, so about the ``pairs`` the tree really attends (block granularity ignored)."""
        return nodes + self.pair_cost * (pairs if self.attention == "flex_attention" else nodes * nodes)

    def pays(self, tree: PrefixTree, flat_cost: float) -> bool:
        """The tree's :meth:`cost` is at least 10% below ``flat_cost`` (the padded or packed rows' cost)."""
        return self.cost(tree.num_nodes, tree.attended_pairs()) < (1.0 - TREE_MIN_GAIN) * flat_cost

    def plan(self, keys: Sequence[Key], token_budget: int, world_size: int, flat_cost: Callable[[list[int]], float],
             *, item_size: int = 1) -> list[RankPlan] | None:
        """Micro-batches of each rank planned by tree size (see
        :func:`~miles_algorithms.planning.plan_prefix_micro_batches`), or None for the flat planner.

        ``keys[r]`` is row ``r``'s real tokens (ids, or ``item_size``-byte items), ``flat_cost(lengths)``
        what rows of those lengths cost in the flat layout. ``auto`` plans by tree only when the
        whole batch's tree is at least 10% smaller than its rows (else the flat plan, exactly as
        without trees), and a planned micro-batch whose tree does not pay is packed again by flat
        tokens, so it keeps to the budget.
        """
        if not self.plans_trees:
            return None
        lengths = [len(k) // item_size for k in keys]
        whole = tree_load(keys, range(len(keys)), item_size)
        if self.mode == "auto" and whole.nodes >= (1.0 - TREE_MIN_GAIN) * sum(lengths):
            return None

        def stays_flat(rows: list[int]) -> bool:
            if self.mode == "on":
                return False
            load = tree_load(keys, rows, item_size)
            flat_tokens = sum(lengths[r] for r in rows)
            return load.nodes == flat_tokens or self.cost(load.nodes, load.pairs) >= (
                1.0 - TREE_MIN_GAIN) * flat_cost([lengths[r] for r in rows])

        return plan_prefix_micro_batches(keys, token_budget, world_size, item_size=item_size, cost=self.cost,
                                         flat=stays_flat)

    def inputs(self, micro: TrainBatch, lengths: list[int], flat_cost: float, device: torch.device) -> ModelInputs | None:
        """The tree inputs of ``micro`` when the policy takes the tree, else None (the flat layout)."""
        if self.mode == "off" or (self.mode == "auto" and self.attention not in TREE_ATTENTION):
            return None
        tree = build_prefix_tree(micro.tokens, lengths)
        if self.mode == "auto" and (tree.num_nodes == tree.flat_tokens or not self.pays(tree, flat_cost)):
            return None
        return tree_inputs(micro, tree, attention=self.attention, device=device)
