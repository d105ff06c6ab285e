"""`Sample`: one rollout (a single turn or a whole multi-turn trajectory) and its outcome.

A sample is the unit that flows from the generator through reward, filter and advantage into a
training batch. Token-level fields are aligned to the *response*: ``tokens[-response_length:]`` is
the response, and ``loss_mask``, ``rollout_logprobs`` (and ``token_versions`` when recorded) have
exactly ``response_length`` entries.

Weight versions are kept twice, on purpose: ``weight_versions`` has one entry per engine call (what
staleness is measured from: a sample is as old as its oldest call), ``token_versions`` one per
response token (what the loss sees: a trajectory that spans a weight update has tokens of two
versions, see ``docs/design/async.md``).

Feature data that only one plugin understands (routed experts for routing replay, teacher
log-probs, tool timings) goes into ``sample.stash`` under a typed :class:`StashKey` that the plugin
owns, so this class never grows a field per feature.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
D = TypeVar("D")


class Status(str, enum.Enum):
    """Lifecycle of a sample. Only COMPLETED and TRUNCATED samples carry a full response."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


class ExitReason(str, enum.Enum):
    """Why a sample ended the way it did (finer than :class:`Status`)."""

    STOP = "stop"  # the model emitted a stop token / string
    LENGTH = "length"  # max_new_tokens reached
    TOOL_CALLS = "tool_calls"  # turn ended in tool calls (intermediate turns of a trajectory)
    CONTEXT_OVERFLOW = "context_overflow"  # prompt plus budget exceeds the context window
    TIMEOUT = "timeout"
    ENGINE_ERROR = "engine_error"
    ABORT = "abort"  # aborted by the engine / router (pause, shutdown, over-sampling)
    TOOL_ERROR = "tool_error"
    FORMAT_ERROR = "format_error"  # malformed tool call or answer format
    AGENT_EXCEPTION = "agent_exception"
    REWARD_ERROR = "reward_error"
    MAX_TURNS = "max_turns"
    MISSING_CAPTURE = "missing_capture"  # a plugin's engine capture is required but absent or broken
    EPISODE_LIMIT = "episode_limit"  # the episode went over tito.max_branches_per_episode / max_sessions_per_episode
    NO_MODEL_CALL = "no_model_call"  # the agent finished without calling the model (ABORTED: its doing, not the engine's)
    # Budgets (a row's settings.budget, else the run's); the training rule of each is in docs/design/debugging.md.
    WALL_CLOCK_BUDGET = "wall_clock_budget"  # the episode ran out of time (ABORTED: not trained)
    TOKEN_BUDGET = "token_budget"  # the episode's turns went over its token budget (TRUNCATED: trained)
    TOOL_TIMEOUT_BUDGET = "tool_timeout_budget"  # more tool calls timed out than tolerated (ABORTED: not trained)


ToBatch = Callable[[Sequence[Any], Sequence[int], int], "torch.Tensor"]
"""``(values, token_lengths, width) -> tensor [B, width, ...]``: how stash values enter a batch."""


class StashKey(Generic[T]):
    """A typed key into :attr:`Sample.stash`. Create one per feature, at module level::

        ROUTED_EXPERTS: StashKey[RoutedExperts] = StashKey("r3.routed_experts", to_batch=collate)
        sample.stash[ROUTED_EXPERTS] = experts

    The name is used when a sample is serialised, in error messages, and as the key of
    ``TrainBatch.extras``. ``to_batch``, when given, makes the data travel into training:
    :meth:`TrainBatch.from_samples` calls it with every row's value (None where a sample has none),
    the rows' token counts and the batch width, and stores the ``[B, width, ...]`` tensor it returns
    in ``extras[name]`` (read it back with :meth:`TrainBatch.extra`). Per-token data is aligned with
    ``tokens``: entry ``[b, t]`` describes token ``t`` of row ``b``.
    """

    __slots__ = ("name", "to_batch")

    def __init__(self, name: str, *, to_batch: ToBatch | None = None) -> None:
        self.name = name
        self.to_batch = to_batch

    def __repr__(self) -> str:
        return f"StashKey({self.name!r})"


class Stash:
    """A mapping from :class:`StashKey` to values, typed per key."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[StashKey[Any], Any] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._data[key] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        try:
            return cast(T, self._data[key])
        except KeyError:
            raise KeyError(f"{key.name!r} is not in this sample's stash") from None

    @overload
    def get(self, key: StashKey[T]) -> T | None: ...
    @overload
    def get(self, key: StashKey[T], default: D) -> T | D: ...
    def get(self, key: StashKey[T], default: Any = None) -> Any:
        return self._data.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __delitem__(self, key: StashKey[Any]) -> None:
        del self._data[key]

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[StashKey[Any]]:
        return iter(list(self._data))

    def keys(self) -> list[StashKey[Any]]:
        return list(self._data)

    def to_dict(self) -> dict[str, Any]:
        """The stash as ``{key name: value}`` (for logging and serialisation)."""
        return {k.name: v for k, v in self._data.items()}

    def copy(self) -> Stash:
        new = Stash()
        new._data = dict(self._data)
        return new


FORK_CAUSES = ("root", "compaction", "rewrite", "retry", "subagent", "spurious")
"""Why a branch of an episode exists: ``root`` (the first branch of a session that has no parent),
``compaction`` (history replaced by something shorter), ``rewrite`` (history edited), ``retry`` (a
turn asked again; the abandoned attempt is the branch), ``subagent`` (the first branch of a session
opened with a parent) and ``spurious`` (the client changed nothing a model would see differently:
a bug to find, counted apart). See ``docs/design/trajectories.md``."""


@dataclass(slots=True)
class Branch:
    """Where a sample sits in its episode's trajectory graph.

    An episode's graph has one node per generated turn; a branch is a chain of turns generated one
    after the other, starting at a root (a fresh prompt) or at a fork from a turn of another branch.
    A branch's sample holds the whole token path from the root to its last turn, with ``loss_mask``
    1 only on the turns the branch itself generated: every model-written token is trained in
    exactly one sample.

    :ivar episode_id: shared by every branch of one episode (all its sessions).
    :ivar branch_id: this branch's number in the episode, in creation order.
    :ivar parent_branch: the branch it forked from; None for a root.
    :ivar fork_turn: the episode turn (``TurnRecord.turn`` in ``session_id``'s parent chain) whose
        tokens this branch continues; None for a root.
    :ivar role: the agent role of the session it belongs to (several agents over one policy).
    :ivar cause: one of :data:`FORK_CAUSES`.
    :ivar session_id: the session whose turns these are.
    :ivar retried: the branch is an abandoned attempt (trained only with ``tito.train_retried``).
    """

    episode_id: str
    branch_id: int
    parent_branch: int | None = None
    fork_turn: int | None = None
    role: str = "agent"
    cause: str = "root"
    session_id: str = ""
    retried: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"episode_id": self.episode_id, "branch_id": self.branch_id, "parent_branch": self.parent_branch,
                "fork_turn": self.fork_turn, "role": self.role, "cause": self.cause, "session_id": self.session_id,
                "retried": self.retried}


class SampleError(ValueError):
    """A sample violates its own invariants (lengths that do not line up)."""


@dataclass(slots=True, eq=False)
class Sample:
    """One rollout. ``tokens = prompt ids + response ids``.

    :ivar prompt: what the data source produced: a string or an OpenAI-style message list.
    :ivar label: the reference answer, if the task has one.
    :ivar tokens: prompt and response token ids, ``[prompt_length + response_length]``.
    :ivar response_length: number of trailing entries of ``tokens`` that form the response. For a
        multi-turn trajectory the response starts at the first model-sampled token and includes the
        tool/user tokens between turns (masked out by ``loss_mask``).
    :ivar response: decoded response text (for rewards and logs).
    :ivar loss_mask: ``[response_length]``; 1 on model-sampled tokens, 0 on everything else.
    :ivar rollout_logprobs: ``[response_length]``; log-prob of each response token under the
        distribution the engine sampled from, 0.0 where ``loss_mask`` is 0.
    :ivar reward: scalar reward once scored.
    :ivar weight_versions: engine weight version of every engine call that produced tokens of this
        sample, in call order.
    :ivar token_versions: ``[response_length]`` or empty (not recorded); the weight version of the
        engine call that sampled each response token, ``-1`` on tokens no engine sampled (tool
        results, template tokens between turns: where ``loss_mask`` is 0).
    :ivar group_index: index of the prompt group (samples of one prompt share it).
    :ivar index: global index of this sample.
    :ivar metadata: JSON-serialisable data from the data source and generator (e.g. ``reward``
        selects the reward function for this sample).
    :ivar stash: typed plugin data (see :class:`StashKey`).
    :ivar branch: where this sample sits in its episode's trajectory graph; None for an episode of
        one linear trajectory.
    :ivar branches: the episode's other branches, each a sample of its own (the generator fills
        them; this sample is the episode's primary branch). Rewards, filters and group statistics
        see the episode (this sample); :meth:`rows` expands it into training rows.
    :ivar role_rewards: per-role rewards of a several-agent episode (a reward function that returns
        ``{role: reward}``); a branch of a role listed here gets that reward, the others ``reward``.
    """

    prompt: str | list[dict[str, Any]] = ""
    label: str | None = None
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    response: str = ""
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    reward: float | None = None
    status: Status = Status.PENDING
    exit_reason: ExitReason | None = None
    exit_detail: str | None = None
    weight_versions: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    group_index: int = 0
    index: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    stash: Stash = field(default_factory=Stash)
    branch: Branch | None = None
    branches: list[Sample] = field(default_factory=list)
    role_rewards: dict[str, float] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :] if self.response_length else []

    @property
    def oldest_weight_version(self) -> int | None:
        return min(self.weight_versions) if self.weight_versions else None

    @property
    def trainable(self) -> bool:
        """Whether the sample can enter a training batch (it has a response and a reward)."""
        return (
            self.status in (Status.COMPLETED, Status.TRUNCATED)
            and self.response_length > 0
            and self.reward is not None
        )

    def rows(self) -> list[Sample]:
        """The episode's training rows: this sample, then its other branches, each given its
        reward (its own when a reward scored the branch itself, else its role's from
        :attr:`role_rewards`, else the episode's) and this sample's group and index, so the rows of
        one episode count as one rollout of their group (``docs/design/trajectories.md``)."""
        if not self.branches:
            return [self]
        own = self.branch.role if self.branch is not None else None
        if own is not None and own in self.role_rewards:
            self.reward = self.role_rewards[own]
        for row in self.branches:
            row.group_index, row.index = self.group_index, self.index
            role = row.branch.role if row.branch is not None else None
            if row.reward is None:
                row.reward = self.role_rewards.get(role, self.reward) if role is not None else self.reward
        return [self, *self.branches]

    def finish(self, status: Status, reason: ExitReason | None, detail: str | None = None) -> Sample:
        """Set the outcome in one place; returns ``self`` for chaining."""
        self.status = status
        self.exit_reason = reason
        self.exit_detail = detail
        return self

    def validate(self) -> None:
        """Raise :class:`SampleError` naming every length invariant this sample breaks."""
        problems = []
        if not 0 <= self.response_length <= len(self.tokens):
            problems.append(f"response_length {self.response_length} not within [0, {len(self.tokens)}]")
        if len(self.loss_mask) != self.response_length:
            problems.append(f"loss_mask has {len(self.loss_mask)} entries, response_length is {self.response_length}")
        if self.rollout_logprobs and len(self.rollout_logprobs) != self.response_length:
            problems.append(
                f"rollout_logprobs has {len(self.rollout_logprobs)} entries, response_length is {self.response_length}"
            )
        if self.token_versions and len(self.token_versions) != self.response_length:
            problems.append(
                f"token_versions has {len(self.token_versions)} entries, response_length is {self.response_length}"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            problems.append("loss_mask holds values other than 0 and 1")
        if problems:
            raise SampleError(f"sample {self.index} (group {self.group_index}): " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable view (stash values are included by name as-is)."""
        return {
            "index": self.index,
            "group_index": self.group_index,
            "prompt": self.prompt,
            "label": self.label,
            "tokens": list(self.tokens),
            "response_length": self.response_length,
            "response": self.response,
            "loss_mask": list(self.loss_mask),
            "rollout_logprobs": list(self.rollout_logprobs),
            "reward": self.reward,
            "status": self.status.value,
            "exit_reason": self.exit_reason.value if self.exit_reason else None,
            "exit_detail": self.exit_detail,
            "weight_versions": list(self.weight_versions),
            "token_versions": list(self.token_versions),
            "metadata": self.metadata,
            "stash": self.stash.to_dict(),
            **({"branch": self.branch.to_dict()} if self.branch is not None else {}),
            **({"branches": [b.to_dict() for b in self.branches]} if self.branches else {}),
            **({"role_rewards": dict(self.role_rewards)} if self.role_rewards else {}),
        }
