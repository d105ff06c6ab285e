"""`TrainBatch`: samples turned into tensors for a train backend, plus the advantage result.

Layout is padded ``[B, T]`` (B rows, T = longest row). Per-token tensors are aligned with
``tokens``: entry ``[b, t]`` describes token ``tokens[b, t]`` as predicted from ``tokens[b, :t]``.
So column 0 is never trainable, and ``logprobs[b, t] = log p(tokens[b, t] | tokens[b, :t])``.
Backends that pack sequences build their packed view from this one (see ``cu_seqlens``).

torch is imported lazily: importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from miles_contracts.sample import Sample, StashKey


@dataclass(slots=True)
class TrainBatch:
    """Tensors of one training step (or one micro-batch of it).

    :ivar tokens: ``[B, T]`` int64, prompt + response ids, right-padded with ``pad_token_id``.
    :ivar attention_mask: ``[B, T]`` int64, 1 on real tokens, 0 on padding.
    :ivar loss_mask: ``[B, T]`` float32, 1 on model-sampled response tokens, else 0.
    :ivar rollout_logprobs: ``[B, T]`` float32, engine log-probs of sampled tokens, 0 off-mask.
    :ivar rewards: ``[B]`` float32, raw scalar reward of each row's rollout.
    :ivar group_ids: ``[B]`` int64, prompt group of each row (GRPO normalises within a group); the
        rows of one prompt group and one agent role when rows belong to episodes of several branches.
    :ivar rollout_ids: ``[B]`` int64, rows with the same id are pieces of one rollout; reductions
        count a rollout once however many rows it was split into. The rows of one episode and one
        agent role are one rollout (:meth:`from_samples`).
    :ivar old_logprobs: ``[B, T]`` trainer log-probs before the update (proximal policy).
    :ivar ref_logprobs: ``[B, T]`` reference-model log-probs (KL).
    :ivar teacher_logprobs: ``[B, T]`` teacher log-probs (on-policy distillation).
    :ivar values: ``[B, T]`` critic values (PPO).
    :ivar advantages: ``[B, T]`` filled by the advantage estimator.
    :ivar returns: ``[B, T]`` filled by estimators with a critic or discounting.
    :ivar token_versions: ``[B, T]`` int64, engine weight version that sampled each token; -1 where
        no engine did (prompt, tool results, padding). None when no sample recorded versions. A
        row whose versions differ spans a weight update (partial rollout); the trainer's current
        version minus an entry is how stale that token is.
    :ivar extras: plugin tensors keyed by name, first dim B. :meth:`from_samples` fills it from
        sample stash keys that have a ``to_batch`` (e.g. routing replay's routed experts
        ``[B, T, moe_layers, top_k]``); read those with :meth:`extra`.
    """

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    rollout_ids: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum().item())

    def extra(self, key: StashKey[object]) -> torch.Tensor | None:
        """The batch tensor of stash key ``key`` (see :class:`~miles_contracts.sample.StashKey`)."""
        return self.extras.get(key.name)

    def select(self, rows: torch.Tensor | Sequence[int]) -> TrainBatch:
        """Rows ``rows`` of every tensor (a micro-batch); columns trimmed to the longest row."""
        import torch

        index = torch.as_tensor(rows, dtype=torch.long, device=self.tokens.device)
        width = int(self.attention_mask[index].sum(dim=1).max().item()) if len(index) else 0
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extras":
                out[f.name] = {k: _take(v, index, width) for k, v in value.items()}
            elif value is not None:
                out[f.name] = _take(value, index, width)
        return replace(self, **out)

    def to(self, device: torch.device | str) -> TrainBatch:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extras":
                out[f.name] = {k: v.to(device) for k, v in value.items()}
            elif value is not None:
                out[f.name] = value.to(device)
        return replace(self, **out)

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], pad_token_id: int) -> TrainBatch:
        """Pad trainable samples into a batch.

        Each row's ``rollout_ids`` is its sample's ``index`` and its ``group_ids`` its
        ``group_index``. When some row is a branch of an episode (``sample.branch``, the rows of
        :meth:`Sample.rows`), both become dense ids, numbered in row order, of ``(index, role)``
        and ``(group_index, role)`` instead (``role = branch.role``, None for a row without a
        branch): the rows of one episode and one role are one rollout, and advantage groups are
        per role, so an episode counts once per role in every rollout-level statistic.

        Stash values whose key has a ``to_batch`` become ``extras`` (one tensor per key that any
        sample carries; the key's ``to_batch`` decides what rows without a value hold).
        ``token_versions`` come from ``sample.token_versions``; a sample that recorded only one
        engine version (``weight_versions``) gets it on every sampled token.
        """
        import torch

        if not samples:
            raise ValueError("cannot build a TrainBatch from zero samples")
        width = max(len(s.tokens) for s in samples)
        b = len(samples)
        tokens = torch.full((b, width), pad_token_id, dtype=torch.long)
        attention = torch.zeros((b, width), dtype=torch.long)
        loss_mask = torch.zeros((b, width), dtype=torch.float32)
        logprobs = torch.zeros((b, width), dtype=torch.float32)
        for row, s in enumerate(samples):
            s.validate()
            n, start = len(s.tokens), s.prompt_length
            tokens[row, :n] = torch.tensor(s.tokens, dtype=torch.long)
            attention[row, :n] = 1
            loss_mask[row, start:n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            if s.rollout_logprobs:
                logprobs[row, start:n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        logprobs = logprobs * loss_mask
        versions = _token_versions(samples, width)
        rewards = torch.tensor([float(s.reward or 0.0) for s in samples], dtype=torch.float32)
        groups, rollouts = _row_ids(samples)
        return cls(tokens, attention, loss_mask, logprobs, rewards, groups, rollouts, token_versions=versions,
                   extras=_stash_extras(samples, width))


def _row_ids(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B]`` group ids and ``[B]`` rollout ids (see :meth:`TrainBatch.from_samples`)."""
    import torch

    if all(s.branch is None for s in samples):
        return (torch.tensor([s.group_index for s in samples], dtype=torch.long),
                torch.tensor([s.index for s in samples], dtype=torch.long))
    roles = [s.branch.role if s.branch is not None else None for s in samples]
    return (_dense([(s.group_index, role) for s, role in zip(samples, roles, strict=True)]),
            _dense([(s.index, role) for s, role in zip(samples, roles, strict=True)]))


def _dense(keys: Sequence[tuple[int, str | None]]) -> torch.Tensor:
    """``[B]`` int64: equal keys get equal ids, numbered 0, 1, ... in order of first appearance."""
    import torch

    ids: dict[tuple[int, str | None], int] = {}
    return torch.tensor([ids.setdefault(key, len(ids)) for key in keys], dtype=torch.long)


def _stash_extras(samples: Sequence[Sample], width: int) -> dict[str, torch.Tensor]:
    collates = {key: key.to_batch for s in samples for key in s.stash if key.to_batch is not None}
    lengths = [len(s.tokens) for s in samples]
    return {key.name: to_batch([s.stash.get(key) for s in samples], lengths, width)
            for key, to_batch in sorted(collates.items(), key=lambda item: item[0].name)}


def _token_versions(samples: Sequence[Sample], width: int) -> torch.Tensor | None:
    import torch

    if not any(s.token_versions or s.weight_versions for s in samples):
        return None
    versions = torch.full((len(samples), width), -1, dtype=torch.long)
    for row, s in enumerate(samples):
        start, end = s.prompt_length, len(s.tokens)
        if s.token_versions:
            versions[row, start:end] = torch.tensor(s.token_versions, dtype=torch.long)
        elif len(set(s.weight_versions)) == 1:
            sampled = torch.tensor(s.loss_mask, dtype=torch.bool)
            versions[row, start:end][sampled] = s.weight_versions[0]
    return versions


def _take(t: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    t = t[index]
    return t[:, :width] if t.dim() >= 2 else t


@dataclass(slots=True)
class AdvantageResult:
    """What an advantage estimator returns.

    :ivar advantages: ``[B, T]``, zero wherever ``loss_mask`` is zero.
    :ivar returns: ``[B, T]`` value targets for a critic, or None.
    :ivar metrics: scalars to log (e.g. ``advantage_mean``).
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
