"""One session's exact token state as a graph of turns, and the checks that keep it exact.

Every generated assistant turn is a :class:`Node`: the conversation it ended (its prompt's messages
and its reply), its *checkpoint* ids (prompt plus sampled ids), its record and the node whose
checkpoint its prompt extends (its parent; None for a turn whose prompt was rendered from scratch).
The session's *head* is the node of its last turn. A request is placed in the graph like this:

1. **base** -- the node with the longest conversation that the request repeats (as
   :meth:`ChatMessage.matches` reads an echo) and extends with new messages of a role the chat family
   allows after an assistant turn. The head is tried first: an agent that appends is the common case
   and costs what a linear conversation costs.
2. **append** -- a base that is a leaf (no turn continues it yet) is extended: the new turn joins
   the base's branch (the head's, or another branch the agent went back to).
3. **fork** -- otherwise the request changed history: a new branch starts, from the base's
   checkpoint (TITO: only the new messages are rendered and tokenized), or from a fresh rendering
   of the whole request when it repeats no generated turn (compaction, an edited first message).
   Its cause is ``retry`` (the request is exactly the prompt of a turn that exists: the abandoned
   attempt, that turn and the rest of its branch, becomes a branch of its own marked ``retried``,
   and the new attempt continues the old branch), ``spurious`` (the first differing message differs
   only in spelling: whitespace, JSON layout -- nothing :meth:`ChatMessage.matches` should not have
   accepted; a bug to find), ``compaction`` (the history got shorter than the prompt of the turn it
   diverged from: fewer messages or fewer characters) or ``rewrite``.
4. **render / tokens** -- the TITO tokenizer requires the rendering with the appended messages to
   extend the rendering without them, and the new prompt must extend the base checkpoint except for
   at most the family's ``max_trim_tokens`` trailing ids.

Branches are numbered per :class:`Episode`, which all sessions of one agent episode share (a
sub-agent's session, several roles) together with its limits: branches, sessions and tokens.

:meth:`prepare` checks and computes the prompt without changing anything; :meth:`commit` applies it
once the engine answered, so a failed engine call leaves the graph as it was. Callers serialise
prepare/commit per conversation (the session server holds a lock across both). ``prepare`` is
:meth:`draft` (the checks and rendering) and :meth:`complete` (the token check) with the new text
tokenized in between; :func:`~miles_tito.turn.run_turn` calls the two itself, to refuse a text too
long for the context before tokenizing it and to tokenize a long one off the event loop.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from miles_contracts import Branch
from miles_contracts.wire.session import FinishReason, MalformedToolCall, TurnCapture, TurnRecord

from miles_tito.errors import EpisodeLimitExceeded, InvalidRequest, RoleNotAllowed, TokenChainBroken
from miles_tito.messages import ChatMessage
from miles_tito.tokenizer import TitoTokenizer

LimitKind = Literal["branches", "sessions", "tokens"]


@dataclass(frozen=True, slots=True)
class EpisodeLimits:
    """Bounds on one episode (all its sessions); going over ends it (``ExitReason.EPISODE_LIMIT``,
    ``TOKEN_BUDGET`` for tokens). ``tokens_from`` names the setting ``max_tokens`` came from."""

    max_branches: int = 64
    max_sessions: int = 16
    max_tokens: int = 1 << 20
    tokens_from: str = "tito.max_tokens_per_episode"


class Episode:
    """What the sessions of one agent episode share: the branch table, counters and limits.

    :ivar limit_hit: why the episode went over a limit (the first time it did), else None.
    :ivar limit_kind: which limit that was: ``branches``, ``sessions`` or ``tokens``.
    """

    def __init__(self, limits: EpisodeLimits | None = None, episode_id: str | None = None) -> None:
        self.id = episode_id or uuid.uuid4().hex
        self.limits = limits or EpisodeLimits()
        self.branches: list[Branch] = []
        self.sessions = 0
        self.tokens = 0  # prompt increments and sampled ids of every turn
        self.limit_hit: str | None = None
        self.limit_kind: LimitKind | None = None

    def check_branches(self, more: int) -> None:
        if len(self.branches) + more > self.limits.max_branches:
            self._over("branches", f"the episode has {len(self.branches)} branches and this request needs {more} more; "
                                   f"the limit is {self.limits.max_branches} (tito.max_branches_per_episode)")

    def check_sessions(self) -> None:
        if self.sessions >= self.limits.max_sessions:
            self._over("sessions", f"the episode has {self.sessions} sessions, the limit (tito.max_sessions_per_episode)")

    def check_tokens(self, more: int) -> None:
        if self.tokens + more > self.limits.max_tokens:
            self._over("tokens", f"the episode holds {self.tokens} tokens and this prompt adds {more}; the limit is "
                                 f"{self.limits.max_tokens} ({self.limits.tokens_from})")

    def _over(self, kind: LimitKind, why: str) -> None:
        if self.limit_hit is None:
            self.limit_hit, self.limit_kind = why, kind
        raise EpisodeLimitExceeded(f"{why}: the episode is over; finish it", param="messages")

    def add_branch(self, **fields: Any) -> Branch:
        branch = Branch(episode_id=self.id, branch_id=len(self.branches), **fields)
        self.branches.append(branch)
        return branch

    def fork_counts(self) -> dict[str, int]:
        return dict(Counter(b.cause for b in self.branches if b.cause != "root"))


@dataclass(slots=True, eq=False)
class Node:
    """A generated turn. ``messages[-1]`` is its reply; ``token_ids`` its checkpoint."""

    record: TurnRecord
    messages: tuple[ChatMessage, ...]
    token_ids: list[int]
    parent: Node | None
    children: list[Node] = field(default_factory=list)

    @property
    def prompt_messages(self) -> tuple[ChatMessage, ...]:
        return self.messages[:-1]


@dataclass(slots=True)
class Fork:
    """A request that starts a branch. ``abandoned``: the turn a retry asks again."""

    cause: str
    parent_branch: int | None
    abandoned: Node | None = None
    reference: Node | None = None  # the turn it diverged from (for the shared token prefix)


@dataclass(slots=True)
class DraftTurn:
    """A checked request whose new text is rendered but not yet tokenized.

    :ivar messages: the prompt's messages, stored spellings for the part the base holds.
    :ivar base: the node whose checkpoint the prompt extends; None: rendered from scratch.
    :ivar head_ids: the base's ids, spliced (empty without a base); the prompt is these followed by
        the ids of ``text``.
    :ivar text: the new messages as the template renders them, with the generation prompt.
    :ivar fork: set when the request starts a branch.
    """

    messages: list[ChatMessage]
    base: Node | None
    head_ids: list[int]
    text: str
    trimmed: int
    fork: Fork | None


@dataclass(slots=True)
class PreparedTurn:
    """A checked request, ready for the engine.

    :ivar input_ids: ``[prompt_len]`` the prompt for the engine.
    :ivar known_positions: leading positions of ``input_ids`` whose per-position engine data
        (captures) the base's turns already hold: the base's call reported positions ``[.., n - 1)``
        of its ``n`` ids, valid up to where the splice replaced trailing ids.
    :ivar added_tokens: ids this prompt adds to the episode's graph (``len(input_ids) - shared_prefix``).
    :ivar shared_prefix: leading ids of ``input_ids`` a recorded turn already holds: the base's
        checkpoint (less trimmed ids), or for a fork rendered from scratch the longest common
        prefix with the turn it diverged from (a system prompt, the history before an edit).
    """

    messages: list[ChatMessage]
    input_ids: list[int]
    base: Node | None
    trimmed: int
    fork: Fork | None
    known_positions: int = 0
    added_tokens: int = 0
    shared_prefix: int = 0


class Conversation:
    """A session's graph of turns (see the module docstring).

    :param episode: the episode the session belongs to (a new one of default limits if None).
    :param session_id: the session's id, recorded on its branches.
    :param role: the agent role of the session.
    :param parent: a sub-agent's parent: the (branch id, turn) that spawned it, in its episode.
    """

    def __init__(self, tito: TitoTokenizer, *, episode: Episode | None = None, session_id: str = "",
                 role: str = "agent", parent: tuple[int, int] | None = None) -> None:
        self.tito = tito
        self.episode = episode or Episode()
        self.session_id = session_id
        self.role = role
        self.parent = parent
        self.nodes: list[Node] = []
        self.head: Node | None = None
        self.branches: list[Branch] = []  # this session's, in creation order

    @property
    def records(self) -> list[TurnRecord]:
        return [n.record for n in self.nodes]

    @property
    def messages(self) -> list[ChatMessage]:
        """The conversation the head turn ended (empty before the first turn)."""
        return list(self.head.messages) if self.head else []

    @property
    def token_ids(self) -> list[int]:
        """The head turn's checkpoint."""
        return list(self.head.token_ids) if self.head else []

    @property
    def turns(self) -> list[Node]:
        """The head's path, root first."""
        return list(reversed(list(_ancestry(self.head))))

    # ------------------------------------------------------------------ checks

    def prepare(
        self, request: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None, extra: Mapping[str, Any] | None = None
    ) -> PreparedTurn:
        """Check ``request`` against the conversation and compute the engine prompt."""
        draft = self.draft(request, tools, extra)
        return self.complete(draft, self.tito.encode(draft.text))

    def draft(
        self, request: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None, extra: Mapping[str, Any] | None = None
    ) -> DraftTurn:
        """The checks of :meth:`prepare` that need no new token ids, and the text to tokenize."""
        if not request:
            raise InvalidRequest("'messages' is empty", param="messages")
        if request[-1].role == "assistant":
            raise InvalidRequest(
                f"messages[{len(request) - 1}] is an assistant message; end with a user, tool or system message "
                f"(continuing an assistant message is not supported)",
                param="messages",
            )
        base = self._base(request)
        fork = self._fork(request, base)
        self.episode.check_branches(1 if fork is not None or not self.nodes else 0)
        if base is None:
            messages = list(request)
            return DraftTurn(messages, None, [], self.tito.first_turn_text(messages, tools, extra), 0, fork)
        history = list(base.messages)
        appended = list(request[len(history):])
        self._check_roles(appended, len(history))
        head, trimmed, text = self.tito.appended_text(history, base.token_ids, appended, tools, extra)
        return DraftTurn([*history, *appended], base, head, text, trimmed, fork)

    def complete(self, draft: DraftTurn, text_ids: list[int]) -> PreparedTurn:
        """The prompt of ``draft`` given the ids of its text; checks that it extends the base. (The
        episode's token limit is the caller's to check, after the context limit: see ``run_turn``.)"""
        input_ids = draft.head_ids + text_ids
        if draft.base is None:
            reference = draft.fork.reference if draft.fork is not None else None
            shared = _common_prefix(input_ids, reference.token_ids) if reference is not None else 0
            return PreparedTurn(draft.messages, input_ids, None, 0, draft.fork, added_tokens=len(input_ids) - shared,
                                shared_prefix=shared)
        previous = draft.base.token_ids
        self._check_token_chain(previous, input_ids, draft.trimmed)
        added = len(input_ids) - (len(previous) - draft.trimmed)
        return PreparedTurn(draft.messages, input_ids, draft.base, draft.trimmed, draft.fork,
                            known_positions=min(len(previous) - 1, len(previous) - draft.trimmed), added_tokens=added,
                            shared_prefix=len(previous) - draft.trimmed)

    def _base(self, request: Sequence[ChatMessage]) -> Node | None:
        """The node with the longest conversation that ``request`` repeats and extends."""
        if self.head is not None and _extends(request, self.head.messages):
            return self.head
        best: Node | None = None
        for node in self.nodes:
            if (best is None or len(node.messages) > len(best.messages)) and _extends(request, node.messages):
                best = node
        return best

    def _fork(self, request: Sequence[ChatMessage], base: Node | None) -> Fork | None:
        """None when ``request`` continues a leaf (or is the session's first); else why it forks."""
        if not self.nodes or (base is not None and not base.children):
            return None
        siblings = base.children if base is not None else [n for n in self.nodes if n.parent is None]
        for child in siblings:
            if len(child.prompt_messages) == len(request) == _matched(request, child.prompt_messages):
                return Fork("retry", child.record.branch, abandoned=child)
        reference = self._closest(request)
        matched = _matched(request, reference.messages)
        cause = "rewrite"
        if matched < len(request) and matched < len(reference.messages) and request[matched].looks_like(reference.messages[matched]):
            cause = "spurious"
        elif len(request) < len(reference.prompt_messages) or _size(request) < _size(reference.prompt_messages):
            cause = "compaction"
        return Fork(cause, reference.record.branch, reference=reference)

    def _closest(self, request: Sequence[ChatMessage]) -> Node:
        """The node whose conversation shares the most leading messages with ``request`` (the head on a tie)."""
        assert self.head is not None
        best, best_matched = self.head, _matched(request, self.head.messages)
        for node in reversed(self.nodes):
            matched = _matched(request, node.messages)
            if matched > best_matched:
                best, best_matched = node, matched
        return best

    def _check_roles(self, appended: Sequence[ChatMessage], first_index: int) -> None:
        allowed = self.tito.family.allowed_append_roles
        for offset, message in enumerate(appended):
            if message.role not in allowed:
                raise RoleNotAllowed(
                    f"messages[{first_index + offset}] has role {message.role!r}, but chat family "
                    f"{self.tito.family.name!r} only allows appending {sorted(allowed)} after an assistant turn",
                    param="messages",
                )

    def _check_token_chain(self, previous: Sequence[int], input_ids: Sequence[int], trimmed: int) -> None:
        limit = self.tito.family.max_trim_tokens
        keep = len(previous) - trimmed
        if trimmed > limit or input_ids[:keep] != list(previous[:keep]):
            position = next((i for i in range(keep) if i >= len(input_ids) or input_ids[i] != previous[i]), keep)
            raise TokenChainBroken(
                f"the new prompt does not extend the previous turn's tokens at token {position} "
                f"(trimmed {trimmed}, family limit {limit}); the chat family's splice rules do not fit this template"
            )

    # ------------------------------------------------------------------ state changes

    def commit(
        self,
        prepared: PreparedTurn,
        *,
        output_ids: list[int],
        output_logprobs: list[float],
        finish_reason: FinishReason,
        weight_version: int,
        message: ChatMessage,
        output_versions: list[int] | None = None,
        format_error: str | None = None,
        malformed_tool_calls: list[MalformedToolCall] | None = None,
        latency_s: float = 0.0,
        captures: dict[str, list[TurnCapture]] | None = None,
    ) -> TurnRecord:
        """Record the engine's answer to ``prepared`` as a node; a retried turn and the rest of its
        branch move to a branch of their own, marked ``retried`` (their records ``rolled_back``)."""
        base = prepared.base
        branch = self._branch_of_new_turn(prepared)
        record = TurnRecord(
            turn=len(self.nodes),
            message_count=len(prepared.messages),
            input_ids=prepared.input_ids,
            output_ids=output_ids,
            output_logprobs=output_logprobs,
            finish_reason=finish_reason,
            weight_version=weight_version,
            output_versions=output_versions,
            message=message.to_openai(),
            format_error=format_error,
            malformed_tool_calls=malformed_tool_calls or [],
            created_at=time.time(),
            latency_s=latency_s,
            captures=captures or {},
            parent_turn=base.record.turn if base is not None else None,
            branch=branch,
            shared_prefix=prepared.shared_prefix,
        )
        node = Node(record, (*prepared.messages, message), prepared.input_ids + output_ids, base)
        if base is not None:
            base.children.append(node)
        self.nodes.append(node)
        self.head = node
        self.episode.tokens += prepared.added_tokens + len(output_ids)
        return record

    def _branch_of_new_turn(self, prepared: PreparedTurn) -> int:
        fork, base = prepared.fork, prepared.base
        if fork is None:
            if base is not None:
                return base.record.branch
            return self._new_branch("subagent" if self.parent else "root", *(self.parent or (None, None))).branch_id
        if fork.abandoned is not None:
            kept = fork.abandoned.record.branch
            retried = self._new_branch("retry", kept, base.record.turn if base else None, retried=True)
            for node in _along_branch(fork.abandoned):
                node.record.branch = retried.branch_id
                node.record.rolled_back = True
            return kept
        return self._new_branch(fork.cause, fork.parent_branch, base.record.turn if base else None).branch_id

    def _new_branch(self, cause: str, parent_branch: int | None, fork_turn: int | None, *, retried: bool = False) -> Branch:
        branch = self.episode.add_branch(parent_branch=parent_branch, fork_turn=fork_turn, role=self.role, cause=cause,
                                         session_id=self.session_id, retried=retried)
        self.branches.append(branch)
        return branch


def _ancestry(node: Node | None) -> Iterator[Node]:
    while node is not None:
        yield node
        node = node.parent


def _along_branch(node: Node) -> Iterator[Node]:
    """``node`` and the turns after it on its branch (a branch is a chain: one child at most shares it)."""
    branch = node.record.branch
    current: Node | None = node
    while current is not None:
        yield current
        current = next((c for c in current.children if c.record.branch == branch), None)


def _matched(request: Sequence[ChatMessage], stored: Sequence[ChatMessage]) -> int:
    matched = 0
    for asked, kept in zip(request, stored, strict=False):
        if not asked.matches(kept):
            break
        matched += 1
    return matched


def _extends(request: Sequence[ChatMessage], stored: Sequence[ChatMessage]) -> bool:
    """Whether ``request`` repeats all of ``stored`` and appends at least one message."""
    return len(request) > len(stored) and _matched(request, stored) == len(stored)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _size(messages: Sequence[ChatMessage]) -> int:
    """Characters a conversation holds (what a compaction shrinks)."""
    return sum(len(m.content) + len(m.reasoning or "") + sum(len(c.arguments) for c in m.tool_calls) for m in messages)
