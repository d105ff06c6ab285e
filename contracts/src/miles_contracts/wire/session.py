"""The session server's records: what ``GET /sessions/{id}`` and ``DELETE /sessions/{id}`` return.

A session records one :class:`TurnRecord` per generated assistant turn. The tokens are exact: each
record holds the prompt ids the engine was given and the ids it produced, so a trajectory is
assembled from records without re-tokenizing any text. The records form a graph (each names the
turn its prompt extends, and its branch): a turn that a client retried is kept with
``rolled_back=True`` (never lost), on a branch of its own; see ``docs/design/trajectories.md``.

``POST /sessions``              :class:`CreateSessionRequest` -> :class:`CreateSessionResponse`
``GET /sessions/{id}``          -> :class:`SessionView` (records, and the trajectory they assemble to)
``DELETE /sessions/{id}``       -> :class:`SessionView` (the final state)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_contracts.capture import CaptureSpec
from miles_contracts.sample import Branch
from miles_contracts.wire.engine import INT32_MAX, MAX_STOP_STRINGS


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class SessionSampling(_Request):
    """Sampling defaults of a session; a chat request's own values win (OpenAI names)."""

    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)


ROLE_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


class SessionParent(_Request):
    """The session and turn that spawned a sub-agent's session (``turn`` None: the parent's last)."""

    session_id: str = Field(max_length=128)
    turn: int | None = Field(default=None, ge=0)


class CreateSessionRequest(_Request):
    """:ivar captures: engine captures every turn of the session carries (see
    :mod:`miles_contracts.capture`); their payloads are kept in the turn records.
    :ivar role: the agent role whose turns the session records (several agents over one policy).
    :ivar parent: open the session as a sub-agent inside the parent's episode (its branches join
        the parent's graph; deleting the parent closes it and returns it with the parent).
    :ivar max_episode_tokens: the new episode's token budget (a data row's ``settings.budget.tokens``);
        it can only lower the server's ``tito.max_tokens_per_episode``. Not with ``parent`` (a
        sub-agent spends its parent's episode budget).
    """

    metadata: dict[str, Any] = Field(default_factory=dict)
    sampling: SessionSampling = Field(default_factory=SessionSampling)
    captures: list[CaptureSpec] = Field(default_factory=list, max_length=8)
    role: str = Field(default="agent", pattern=ROLE_PATTERN)
    parent: SessionParent | None = None
    max_episode_tokens: int | None = Field(default=None, ge=1)


class ChildSessionRequest(_Request):
    """``POST /sessions/{id}/v1/children`` with the session's own key: a sub-agent (or another
    role's) session in the same episode, spawned at ``parent_turn`` (None: the last turn).
    Sampling defaults and engine captures are the parent's."""

    role: str = Field(default="agent", pattern=ROLE_PATTERN)
    parent_turn: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] = Field(default_factory=dict)


class CreateSessionResponse(_Response):
    session_id: str
    base_url: str = Field(description="OpenAI base URL of the session: <server>/sessions/<id>/v1")
    api_key: str | None = Field(default=None, description="key for the session's own OpenAI routes only "
                                "(the agent's OpenAI api_key); records and deletion need the run's token")


FinishReason = Literal["stop", "length", "tool_calls"]


class TurnCapture(_Response):
    """What one engine call of a turn returned for a capture: ``payload`` covers positions
    ``[start, start + rows)`` of the turn's ``input_ids + output_ids`` (None: the engine sent none).
    A turn a weight update interrupted (partial rollout) made several calls: one piece each."""

    start: int
    rows: int
    payload: Any = None


class MalformedToolCall(_Response):
    """A tool call the model wrote but the chat family's parser could not read. It is kept, never
    dropped: the client got the turn's text as plain content (finish reason ``stop`` / ``end_turn``,
    no call), the record holds this, the sample counts it (``metadata["tool_calls"]``).

    :ivar status: always ``malformed`` (a readable call is in ``message.tool_calls``).
    :ivar error: what the parser found wrong.
    :ivar span: ``[start, end)`` of the turn's ``output_ids`` that hold the unreadable call (from
        where it starts to the end of the turn's text).
    :ivar text: the decoded text of that span.
    """

    status: Literal["malformed"] = "malformed"
    error: str
    span: tuple[int, int]
    text: str


class TurnRecord(_Response):
    """One engine call that produced an assistant turn.

    :ivar turn: position of this record in the session (0-based, rolled-back turns included).
    :ivar message_count: how many request messages this turn answered.
    :ivar input_ids: ``[prompt_len]`` the exact ids sent to the engine.
    :ivar output_ids: ``[completion_len]`` the ids the engine sampled.
    :ivar output_logprobs: ``[completion_len]`` log-prob of each sampled id.
    :ivar weight_version: engine weight version that produced it (0 when the engine has none); the
        oldest one when the turn spans a weight update.
    :ivar output_versions: ``[completion_len]`` the version that sampled each output id, set only
        when the turn spans a weight update (partial rollout); None: all ``weight_version``.
    :ivar message: the assistant message returned to the client (content, reasoning, tool calls).
    :ivar format_error: set when the output held a malformed tool call (returned as text).
    :ivar malformed_tool_calls: that call, with its token span (empty when every call was read).
    :ivar rolled_back: a later request retried this turn (or one before it on its branch): it is
        on a branch marked ``retried``.
    :ivar parent_turn: the session turn whose ids this turn's prompt extends; None when the prompt
        was rendered from scratch (a session's first turn, a compaction).
    :ivar branch: the episode branch the turn belongs to (``SessionView.branches``).
    :ivar shared_prefix: leading ``input_ids`` a turn recorded before already holds: the parent's
        checkpoint, or for a prompt rendered from scratch after a fork the longest common prefix
        with the turn it diverged from (what a prefix cache need not compute again).
    :ivar captures: the session's engine captures of this turn, by capture name: one piece per engine
        call, in order (several when a weight update interrupted the turn).
    """

    turn: int
    message_count: int
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0
    output_versions: list[int] | None = None
    message: dict[str, Any]
    format_error: str | None = None
    malformed_tool_calls: list[MalformedToolCall] = Field(default_factory=list)
    rolled_back: bool = False
    created_at: float
    latency_s: float = 0.0
    captures: dict[str, list[TurnCapture]] = Field(default_factory=dict)
    parent_turn: int | None = None
    branch: int = 0
    shared_prefix: int = 0


class RequestFailure(_Response):
    """A chat request that produced no turn (kept so a collector can tell why a trajectory ended)."""

    at: float
    status_code: int
    code: str
    message: str


class TrajectoryView(_Response):
    """The active records assembled into one trajectory (what the agentic generator trains on).

    :ivar tokens: ``[prompt_length + response_length]`` the whole conversation.
    :ivar loss_mask: ``[response_length]`` 1 on ids a turn sampled, 0 on everything else.
    :ivar rollout_logprobs: ``[response_length]`` the engine's log-prob of each sampled id, 0.0 elsewhere.
    :ivar weight_versions: one per engine call that produced tokens.
    :ivar token_versions: ``[response_length]`` the version that sampled each id, -1 elsewhere.
    """

    tokens: list[int]
    prompt_length: int
    response_length: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    weight_versions: list[int]
    token_versions: list[int] = Field(default_factory=list)
    status: str
    exit_reason: str | None = None


class SessionView(_Response):
    """A session's state.

    :ivar token_ids: the conversation so far: the last active turn's ``input_ids + output_ids``.
    :ivar records: every turn, in order (rolled-back ones included and marked).
    :ivar failures: requests that produced no turn (the latest 64; the server keeps no more).
    :ivar failures_dropped: how many earlier failed requests were not kept.
    :ivar max_trim_tokens: the chat family's limit, needed to assemble the records.
    :ivar trajectory: the head turn's path assembled (None before the first turn).
    :ivar trajectory_error: why the records could not be assembled, if they could not.
    :ivar episode_id: the episode the session belongs to (its sub-agents' sessions share it).
    :ivar role: the session's agent role.
    :ivar parent: the session and turn that spawned it (a sub-agent), else None.
    :ivar head_turn: the session's last generated turn (the one ``messages`` ends with).
    :ivar branches: the episode branches holding this session's turns.
    :ivar forks: the episode's forks so far, by cause.
    :ivar episode_limit: why the episode went over a limit, if it did (it is then over).
    :ivar episode_limit_kind: which limit: ``branches``, ``sessions`` or ``tokens`` (its token budget).
    :ivar children: on deleting an episode's first session: every other session of the episode,
        in its final state (they are closed with it).
    """

    session_id: str
    family: str
    created_at: float
    metadata: dict[str, Any] = Field(default_factory=dict)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    records: list[TurnRecord] = Field(default_factory=list)
    failures: list[RequestFailure] = Field(default_factory=list)
    failures_dropped: int = 0
    max_trim_tokens: int = 0
    closed: bool = False
    trajectory: TrajectoryView | None = None
    trajectory_error: str | None = None
    episode_id: str = ""
    role: str = "agent"
    parent: SessionParent | None = None
    head_turn: int | None = None
    branches: list[Branch] = Field(default_factory=list)
    forks: dict[str, int] = Field(default_factory=dict)
    episode_limit: str | None = None
    episode_limit_kind: Literal["branches", "sessions", "tokens"] | None = None
    children: list[SessionView] = Field(default_factory=list)

    @property
    def active_records(self) -> list[TurnRecord]:
        """The head turn's path, first turn first."""
        return self.path(self.head_turn)

    def path(self, turn: int | None) -> list[TurnRecord]:
        """Turn ``turn`` and the turns whose ids its prompt extends, first turn first."""
        path = []
        while turn is not None:
            record = self.records[turn]
            path.append(record)
            turn = record.parent_turn
        return path[::-1]
