"""What a replayed forward needs, whatever the backend: the recorded experts lined up with the
tokens the routers see, the choice at each router, and the agreement statistics.

A :class:`ReplayTable` holds, for one forward, ``forced [N, moe_layers, top_k]`` (the rollout's
experts of the ``N`` tokens the model's layers see, in that order) and ``recorded [N]`` (False for
tokens without a record: each row's last token, padding, rows without data). A :class:`Replayer`
is bound to one model's routers (:mod:`miles_r3.hf`, :mod:`miles_r3.megatron`); the forward
wrapper arms it with the table, each router asks :meth:`Replayer.choose` with its own top-k and
gets the experts to use.

Activation checkpointing runs each layer's forward again during backward; the recomputation must
route exactly as the forward did, so a table armed for a checkpointed training forward stays armed
until every router has used it twice (or the next forward replaces it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

import torch


@dataclass(slots=True)
class PhaseCounts:
    """Agreement counters of one forward phase (``old_logprobs``, ``train``, ...).

    :ivar pairs: (recorded token, MoE layer) pairs compared.
    :ivar same_pairs: pairs where the trainer's own top-k set equals the rollout's.
    :ivar shared_experts: experts in both sets, summed over pairs.
    :ivar rollout_experts: experts the rollout chose, summed over pairs (``pairs * top_k``).
    :ivar tokens: recorded tokens.
    :ivar same_tokens: recorded tokens whose own top-k equals the rollout's in every MoE layer.
    :ivar unrecorded_tokens: tokens of the batch (not padding) the routers saw without a record.
    :ivar exact_pairs: pairs of forwards that must route exactly as the rollout did (true
        on-policy: the weights that sampled the batch, the engine's invariant forward).
    :ivar exact_mismatched_pairs: those of them routed to another set of experts.
    """

    pairs: int = 0
    same_pairs: int = 0
    shared_experts: int = 0
    rollout_experts: int = 0
    tokens: int = 0
    same_tokens: int = 0
    unrecorded_tokens: int = 0
    exact_pairs: int = 0
    exact_mismatched_pairs: int = 0

    def add(self, other: PhaseCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class RoutingStats:
    """Counters per phase, accumulated over a step's forwards and flushed into its metrics."""

    def __init__(self) -> None:
        self._phases: dict[str, PhaseCounts] = {}
        self._lock = threading.Lock()

    def add(self, phase: str, counts: PhaseCounts) -> None:
        with self._lock:
            self._phases.setdefault(phase, PhaseCounts()).add(counts)

    def flush(self) -> dict[str, float]:
        """``r3/<phase>/...`` metrics since the last flush (nothing when nothing was replayed):

        * ``routing_agreement``: share of (token, MoE layer) pairs where the trainer's own top-k
          set equals the rollout's;
        * ``token_agreement``: share of tokens on which it does in every MoE layer;
        * ``expert_overlap``: share of the rollout's experts the trainer chose too;
        * ``replayed_tokens`` / ``unrecorded_tokens``: tokens with / without a record;
        * ``true_on_policy_checked_pairs`` / ``true_on_policy_mismatched_pairs``: pairs of the
          forwards that must route exactly as the rollout (see :meth:`ReplayTable.first_mismatch`),
          and how many did not (only when there were such forwards).
        """
        with self._lock:
            phases, self._phases = self._phases, {}
        out: dict[str, float] = {}
        for phase, c in sorted(phases.items()):
            prefix = f"r3/{phase}/"
            out[prefix + "replayed_tokens"] = float(c.tokens)
            out[prefix + "unrecorded_tokens"] = float(max(c.unrecorded_tokens, 0))
            if c.pairs:
                out[prefix + "routing_agreement"] = c.same_pairs / c.pairs
                out[prefix + "token_agreement"] = c.same_tokens / max(c.tokens, 1)
                out[prefix + "expert_overlap"] = c.shared_experts / c.rollout_experts
            if c.exact_pairs:
                out[prefix + "true_on_policy_checked_pairs"] = float(c.exact_pairs)
                out[prefix + "true_on_policy_mismatched_pairs"] = float(c.exact_mismatched_pairs)
        return out


class ReplayTable:
    """The recorded experts of one forward, and its agreement counters (kept on the device until
    the forward is done, so routers never wait for the host).

    :param forced: ``[N, moe_layers, top_k]`` integer expert ids, in the routers' token order.
    :param recorded: ``[N]`` bool, False where ``forced`` holds no record.
    :param uses: times each router will run on this table (2 when backward recomputes it).
    :param unrecorded: ``[]`` tokens of the batch without a record besides each row's last token.
    :param exact: the forward must route every recorded token exactly as the rollout did (true
        on-policy); the table then keeps each router's disagreements for :meth:`first_mismatch`.
    :param positions: ``[N]`` flat ``[b, t]`` index of each token (``token_positions``), kept so a
        mismatch can be named by batch row and column.
    """

    def __init__(self, forced: torch.Tensor, recorded: torch.Tensor, *, phase: str, replay: bool, uses: int,
                 unrecorded: torch.Tensor | int = 0, exact: bool = False, positions: torch.Tensor | None = None) -> None:
        self.forced, self.recorded, self.phase, self.replay, self.exact = forced, recorded, phase, replay, exact
        self.positions = positions
        self._differs: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (column, [N] bool, own [N, k]) if exact
        self._uses = uses
        self.uses_left = [uses] * forced.shape[1]
        self.unrecorded = unrecorded
        device = forced.device
        self._same_pairs = torch.zeros((), dtype=torch.long, device=device)
        self._shared = torch.zeros((), dtype=torch.long, device=device)
        self._all_same = recorded.clone()
        self._layers_seen = 0

    @property
    def tokens(self) -> int:
        return int(self.forced.shape[0])

    @property
    def done(self) -> bool:
        return all(n <= 0 for n in self.uses_left)

    def choose(self, column: int, own: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(experts [N, top_k] int64, recorded [N])`` for the router of MoE layer ``column``:
        the recorded experts where there is a record, ``own`` (the router's top-k) elsewhere."""
        if own.shape != (self.tokens, self.forced.shape[2]):
            raise RuntimeError(
                f"routing replay: {where} routed {tuple(own.shape)} (tokens, top_k) but the recorded experts are for "
                f"{self.tokens} tokens x top-{self.forced.shape[2]}; the backend's token_positions do not match what "
                f"the router sees"
            )
        forced = self.forced[:, column].to(device=own.device, dtype=torch.long)
        recorded = self.recorded.to(own.device)
        if self.uses_left[column] == self._uses:  # the forward itself, not its recomputation
            self._count(column, own, forced, recorded)
        self.uses_left[column] -= 1
        return torch.where(recorded[:, None], forced, own.long()), recorded

    def _count(self, column: int, own: torch.Tensor, forced: torch.Tensor, recorded: torch.Tensor) -> None:
        own = own.long()
        agree = (own.sort(dim=-1).values == forced.sort(dim=-1).values).all(dim=-1)
        same = agree & recorded
        if self.exact:
            self._differs.append((column, recorded & ~agree, own))
        self._same_pairs += same.sum()
        self._shared += ((own[:, :, None] == forced[:, None, :]).any(dim=-1) & recorded[:, None]).sum()
        self._all_same &= same | ~recorded
        self._layers_seen += 1

    def counts(self) -> PhaseCounts:
        """The counters: one device-to-host copy of all five (not a sync per counter)."""
        device = self.recorded.device
        values = torch.stack([self.recorded.sum(), torch.as_tensor(self.unrecorded, device=device).long(),
                              self._same_pairs, self._shared, self._all_same.sum()]).tolist()
        tokens, unrecorded, same_pairs, shared, same_tokens = (int(v) for v in values)
        if not self._layers_seen:
            return PhaseCounts(unrecorded_tokens=unrecorded)
        exact = tokens * self._layers_seen if self.exact else 0
        return PhaseCounts(
            pairs=tokens * self._layers_seen, same_pairs=same_pairs, shared_experts=shared,
            rollout_experts=tokens * self._layers_seen * int(self.forced.shape[2]), tokens=tokens,
            same_tokens=same_tokens, unrecorded_tokens=unrecorded, exact_pairs=exact,
            exact_mismatched_pairs=exact - same_pairs if self.exact else 0,
        )

    def first_mismatch(self) -> tuple[int, int, list[int], list[int], int, int] | None:
        """For an ``exact`` table after its forward: ``(token, column, own experts, rollout's
        experts, mismatched pairs, checked pairs)`` of the first recorded (token, MoE layer) pair
        (token order, then layer order) whose experts differ from the rollout's; None when all agree."""
        if not self._differs:
            return None
        self._differs.sort(key=lambda d: d[0])
        differs = torch.stack([d for _, d, _ in self._differs], dim=1)  # [N, columns seen]
        count = int(differs.sum())
        if not count:
            return None
        token, at = (int(i) for i in differs.nonzero()[0])
        column, _, own = self._differs[at]
        checked = int(self.recorded.sum()) * len(self._differs)
        return token, column, own[token].tolist(), self.forced[token, column].long().tolist(), count, checked


def line_up(experts: torch.Tensor, positions: torch.Tensor, num_experts: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's recorded experts in the routers' token order.

    :param experts: ``[b, t, moe_layers, top_k]`` (``num_experts`` = no record), see
        :func:`miles_r3.experts.to_batch`.
    :param positions: ``[N]`` flat index into ``[b, t]`` of each token the routers see, -1 for
        padding (``ForwardContext.state["token_positions"]``).
    :param rows: rows of the micro-batch (each has one unrecorded last token).
    :returns: ``forced [N, moe_layers, top_k]``, ``recorded [N]`` and the count of tokens without a
        record besides each row's last one (a 0-dim tensor).
    """
    b, t, layers, k = experts.shape
    positions = positions.to(experts.device)
    forced = experts.reshape(b * t, layers, k)[positions.clamp(min=0)]
    real = positions >= 0
    recorded = real & (forced[:, 0, 0].to(torch.int64) < num_experts)
    return forced, recorded, (real & ~recorded).sum() - rows


class Replayer:
    """Routing replay bound to one model's routers; subclasses hook the routers and call
    :meth:`choose`. ``num_experts``, ``top_k`` and ``columns`` (MoE layers it replays) describe
    the tables it accepts."""

    num_experts: int
    top_k: int
    columns: int

    def __init__(self, stats: RoutingStats) -> None:
        self.stats = stats
        self.table: ReplayTable | None = None
        self._keep = False

    def recomputes(self, model: torch.nn.Module) -> bool:
        """Whether backward will run the routers of a training forward again (checkpointing)."""
        return False

    def arm(self, table: ReplayTable, *, keep_for_recompute: bool) -> None:
        self._finish()
        self.table, self._keep = table, keep_for_recompute

    def release(self) -> None:
        """End of the forward: disarm, unless backward's recomputation still needs the table."""
        if not self._keep:
            self._finish()

    def choose(self, column: int, own: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts router ``column`` must use, with the recorded mask; None when no table is
        armed or the run only measures (``r3.replay: false``)."""
        table = self.table
        if table is None:
            return None
        chosen = table.choose(column, own, where)
        if table.done:
            self._finish()
        return chosen if table.replay else None

    def _finish(self) -> None:
        table, self.table = self.table, None
        if table is not None:
            self.stats.add(table.phase, table.counts())
