"""Sessions and what the endpoints do with them, independent of the HTTP framework.

Each session owns a :class:`Conversation` and an ``asyncio.Lock``. A chat request holds the lock
from the checks through the engine call to the commit, so two requests on one session run one
after the other: the second sees the first's turn (and, if it repeats the same messages, retries
that turn by rolling it back). Different sessions never wait for each other.

Deleting marks the session closing (new and queued requests get 409 ``session_closing``), waits for
the request in flight to commit, removes the session and returns its final state: a turn that was
generating when the delete arrived is in that state, not lost.

A session nobody has used for ``idle_timeout`` seconds (an agent that crashed before its generator
could delete it) is expired: removed, logged with its turn count, and remembered, so a late request
for it gets a 404 that says it expired rather than that it never existed. A session with a request
in flight or being deleted never expires. Without this a long run's server would keep every
abandoned session's tokens forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from miles_contracts import CaptureSpec, EngineClient
from miles_contracts.wire.auth import new_session_key
from miles_contracts.wire.engine import SamplingParams
from miles_contracts.wire.session import (
    ChildSessionRequest,
    CreateSessionRequest,
    RequestFailure,
    SessionParent,
    SessionSampling,
    SessionView,
    TrajectoryView,
    TurnRecord,
)
from pydantic import ValidationError

from miles_tito.assembly import AssemblyError, assemble
from miles_tito.conversation import Conversation, Episode, EpisodeLimits
from miles_tito.errors import InvalidRequest, SessionClosing, SessionNotFound, TitoError, TurnNotFound
from miles_tito.messages import ChatMessage, MessageError
from miles_tito.server import responses_request
from miles_tito.server.messages_request import MessagesRequest, chat_messages, parse_messages_request
from miles_tito.server.responses_request import ResponsesRequest, parse_responses_request
from miles_tito.server.responses_response import new_response_id
from miles_tito.server.schema import ChatCompletionRequest, parse_chat_request
from miles_tito.tokenizer import TitoTokenizer
from miles_tito.turn import TurnRequest, TurnResult, run_turn

log = logging.getLogger(__name__)
RequestModel = TypeVar("RequestModel", CreateSessionRequest, ChildSessionRequest)
EXPIRED_MEMORY = 10_000
"""Most expired session ids remembered (for the 404 that says so); the oldest are forgotten first."""
FAILURES_KEPT = 64
"""Failed requests a session remembers, the latest; older ones are only counted. A client with the
session's key could otherwise grow its memory without bound (2,000 entries in 11 s were measured)."""
FAILURE_MESSAGE_CHARS = 1000
"""A remembered failure's message is cut to this length (messages may quote what the client sent)."""
RESPONSES_KEPT = 64
"""Responses a session remembers for ``previous_response_id``, the latest. An agent continues from
its last response (or one a few turns back, which starts a branch); each kept response is a tuple
of references to the session's immutable messages."""


class RouteRequest(Protocol):
    """What the chat, Messages and Responses routes' requests all give a turn."""

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None: ...

    @property
    def parse_tool_calls(self) -> bool: ...

    def sampling(self, defaults: SessionSampling, default_max_tokens: int) -> SamplingParams: ...


@dataclass(slots=True)
class Session:
    id: str
    conversation: Conversation
    sampling: SessionSampling
    metadata: dict[str, Any]
    created_at: float = field(default_factory=time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    failures: deque[RequestFailure] = field(default_factory=lambda: deque(maxlen=FAILURES_KEPT))
    failures_dropped: int = 0  # older failures than the ones kept
    captures: list[CaptureSpec] = field(default_factory=list)  # engine captures every turn carries
    closing: bool = False
    last_used: float = field(default_factory=time.monotonic)
    api_key: str = field(default_factory=new_session_key)  # reaches this session only
    # Responses route: response id -> the conversation it ended with (without its instructions)
    responses: OrderedDict[str, tuple[ChatMessage, ...]] = field(default_factory=OrderedDict)
    parent: SessionParent | None = None  # a sub-agent's: the session and turn that spawned it
    root: Session | None = None  # a sub-agent's: its episode's first session
    # the episode's first session: the other sessions of its episode, open or finished
    children: list[Session] = field(default_factory=list)
    final_view: SessionView | None = None  # set once deleted


@dataclass(slots=True)
class ChatOutcome:
    request: ChatCompletionRequest
    result: TurnResult


@dataclass(slots=True)
class MessagesOutcome:
    request: MessagesRequest
    result: TurnResult


@dataclass(slots=True)
class ResponsesOutcome:
    request: ResponsesRequest
    result: TurnResult
    response_id: str


class SessionService:
    """All sessions of one server.

    :param engine: client for the router (or one engine); the session id is the routing key.
    :param tito: tokenizer of the served model and its chat family.
    :param model_name: the name responses report.
    :param max_context_len: prompt plus completion limit, in tokens.
    :param default_max_tokens: completion budget when neither request nor session sets one.
    :param episode_limits: branches, sessions and tokens one episode (a session and its sub-agents) may have.
    :param idle_timeout: seconds without a request after which a session expires; None: never.
    """

    def __init__(
        self,
        engine: EngineClient,
        tito: TitoTokenizer,
        *,
        model_name: str,
        max_context_len: int = 32768,
        default_max_tokens: int = 1024,
        episode_limits: EpisodeLimits | None = None,
        delete_timeout: float = 600.0,
        idle_timeout: float | None = 3600.0,
        partial_rollout: bool = False,
    ) -> None:
        if idle_timeout is not None and idle_timeout <= 0:
            raise ValueError(f"idle_timeout must be > 0 seconds (or None for never), got {idle_timeout}")
        self.engine = engine
        self.tito = tito
        self.model_name = model_name
        self.max_context_len = max_context_len
        self.default_max_tokens = default_max_tokens
        self.episode_limits = episode_limits or EpisodeLimits()
        self.delete_timeout = delete_timeout
        self.idle_timeout = idle_timeout
        self.partial_rollout = partial_rollout  # continue turns a weight update aborted (TurnRequest.continue_aborted)
        self.sessions: dict[str, Session] = {}
        self.expired: OrderedDict[str, float] = OrderedDict()  # id -> seconds it had been idle
        # id -> SHA-256 of the api_key of a deleted or expired session: its agent gets 404 (gone), not 401
        self.retired_keys: OrderedDict[str, bytes] = OrderedDict()
        self._next_sweep = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    def create(self, body: Any = None) -> Session:
        """A new session: the first of a new episode, or with ``parent`` a sub-agent's in the parent's."""
        request = _validated(CreateSessionRequest, body)
        self.expire_idle()
        if request.parent is None:
            return self._add(request.role, request.metadata, request.sampling, list(request.captures), None,
                             episode=self._new_episode(request.max_episode_tokens))
        if request.max_episode_tokens is not None:
            raise InvalidRequest("max_episode_tokens: a sub-agent's session spends its parent's episode budget; "
                                 "set the budget when creating the episode's first session", param="max_episode_tokens")
        parent = self._open(request.parent.session_id)
        return self._spawn(parent, request.parent.turn, request.role, request.metadata, request.sampling,
                           list(request.captures))

    def create_child(self, session_id: str, body: Any = None) -> Session:
        """``POST /sessions/{id}/v1/children``: the agent's own way to open a sub-agent's session
        (with its session key; the child inherits sampling defaults and captures)."""
        parent = self._open(session_id)
        try:
            request = _validated(ChildSessionRequest, body)
        except TitoError as exc:
            raise self._fail(parent, exc) from None
        return self._spawn(parent, request.parent_turn, request.role, request.metadata, parent.sampling,
                           list(parent.captures))

    def _spawn(self, parent: Session, turn: int | None, role: str, metadata: dict[str, Any],
               sampling: SessionSampling, captures: list[CaptureSpec]) -> Session:
        conversation = parent.conversation
        if turn is None:
            turn = conversation.head.record.turn if conversation.head is not None else None
        elif turn >= len(conversation.nodes):
            raise TurnNotFound(f"parent.turn: session {parent.id} has {len(conversation.nodes)} turns, no turn {turn}",
                               param="parent.turn")
        link = (conversation.nodes[turn].record.branch, turn) if turn is not None else None
        root = parent.root or parent
        child = self._add(role, metadata, sampling, captures, SessionParent(session_id=parent.id, turn=turn),
                          episode=conversation.episode, link=link)
        child.root = root
        root.children.append(child)
        return child

    def _new_episode(self, max_tokens: int | None) -> Episode:
        """An episode with the server's limits, its token budget lowered to ``max_tokens`` when given."""
        limits = self.episode_limits
        if max_tokens is not None and max_tokens < limits.max_tokens:
            limits = replace(limits, max_tokens=max_tokens, tokens_from="the session's max_episode_tokens")
        return Episode(limits)

    def _add(self, role: str, metadata: dict[str, Any], sampling: SessionSampling, captures: list[CaptureSpec],
             parent: SessionParent | None, *, episode: Episode | None = None,
             link: tuple[int, int] | None = None) -> Session:
        episode = episode or Episode(self.episode_limits)
        episode.check_sessions()
        session_id = uuid.uuid4().hex
        conversation = Conversation(self.tito, episode=episode, session_id=session_id, role=role,
                                    parent=link if parent is not None else None)
        session = Session(id=session_id, conversation=conversation, sampling=sampling, metadata=metadata,
                          captures=captures, parent=parent)
        episode.sessions += 1
        self.sessions[session.id] = session
        return session

    def accepts_session_key(self, path: str, presented: str) -> bool:
        """Whether ``presented`` is the ``api_key`` of the session whose OpenAI routes ``path`` is
        under (``/sessions/<id>/v1/...``); constant-time. Records and deletion need the run's token."""
        parts = path.split("/")
        if len(parts) < 5 or parts[1] != "sessions" or parts[3] != "v1":
            return False
        session = self.sessions.get(parts[2])
        if session is not None:
            return hmac.compare_digest(session.api_key.encode(), presented.encode())
        retired = self.retired_keys.get(parts[2])  # the route answers 404 with why the session is gone
        return retired is not None and hmac.compare_digest(retired, hashlib.sha256(presented.encode()).digest())

    def _retire(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        self.retired_keys[session.id] = hashlib.sha256(session.api_key.encode()).digest()
        while len(self.retired_keys) > EXPIRED_MEMORY:
            self.retired_keys.popitem(last=False)

    def get(self, session_id: str) -> Session:
        self.expire_idle()
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self.expired:
                raise SessionNotFound(
                    f"session {session_id!r} expired after {self.expired[session_id]:.0f} s without a request "
                    f"(the server's idle timeout is {self.idle_timeout:.0f} s); create a new one with POST /sessions"
                )
            raise SessionNotFound(f"no session {session_id!r}: it was never created or is already deleted; create one with POST /sessions")
        session.last_used = time.monotonic()
        return session

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Remove sessions idle for longer than ``idle_timeout`` (checked at most once a second);
        returns their ids."""
        now = time.monotonic() if now is None else now
        if self.idle_timeout is None or now < self._next_sweep:
            return []
        self._next_sweep = now + min(1.0, self.idle_timeout / 10)
        stale = [s for s in self.sessions.values()
                 if now - s.last_used > self.idle_timeout and not s.closing and not s.lock.locked()]
        for session in stale:
            self._retire(session)
            self.expired[session.id] = now - session.last_used
            log.warning("session %s expired after %.0f s without a request (%d turns, %d tokens)", session.id,
                        now - session.last_used, len(session.conversation.records), len(session.conversation.token_ids))
        while len(self.expired) > EXPIRED_MEMORY:
            self.expired.popitem(last=False)
        return [s.id for s in stale]

    def view(self, session: Session) -> SessionView:
        if session.final_view is not None:
            return session.final_view
        return conversation_view(
            session.conversation, created_at=session.created_at, metadata=session.metadata,
            failures=list(session.failures), failures_dropped=session.failures_dropped, closed=session.closing,
            parent=session.parent, children=[self.view(c) for c in session.children],
        )

    async def delete(self, session_id: str) -> SessionView:
        """Close the session (and, for an episode's first session, every other session of the
        episode) once its request in flight committed; its final state, children included."""
        session = self.get(session_id)
        await asyncio.gather(*(self._close(s) for s in [session, *session.children] if s.final_view is None))
        for child in session.children:
            child.final_view = child.final_view or self.view(child)
        session.final_view = self.view(session)
        return session.final_view

    async def _close(self, session: Session) -> None:
        session.closing = True
        try:
            await asyncio.wait_for(session.lock.acquire(), timeout=self.delete_timeout)
        except TimeoutError:
            pass  # the request in flight never finished; delete anyway, with what was committed
        else:
            session.lock.release()
        self._retire(session)

    # ------------------------------------------------------------------ turns

    def _turn(self, session: Session, messages: list[ChatMessage], request: RouteRequest,
              template_extra: dict[str, Any] | None = None) -> TurnRequest:
        """The turn every route runs: its messages, and the tools and sampling its request reads."""
        return TurnRequest(
            messages=messages,
            tools=request.tool_dicts,
            sampling=request.sampling(session.sampling, self.default_max_tokens),
            parse_tool_calls=request.parse_tool_calls,
            template_extra=template_extra,
            captures=session.captures,
            continue_aborted=self.partial_rollout,
        )

    async def chat(self, session_id: str, body: Any) -> ChatOutcome:
        session = self._open(session_id)
        try:
            request = parse_chat_request(body)
            messages = ChatMessage.list_from_openai(request.messages)
            turn = self._turn(session, messages, request, template_extra=self._template_extra(request))
        except MessageError as exc:
            raise self._fail(session, InvalidRequest(str(exc), param="messages")) from None
        except TitoError as exc:
            raise self._fail(session, exc) from None
        return ChatOutcome(request, await self._run(session, turn))

    async def messages(self, session_id: str, body: Any) -> MessagesOutcome:
        """An Anthropic Messages request: read into the chat route's turn (see
        :mod:`~miles_tito.server.messages_request`), run and recorded exactly as a chat turn is."""
        session = self._open(session_id)
        try:
            request = parse_messages_request(body)
            turn = self._turn(session, chat_messages(request), request)
        except TitoError as exc:
            raise self._fail(session, exc) from None
        return MessagesOutcome(request, await self._run(session, turn))

    async def responses(self, session_id: str, body: Any) -> ResponsesOutcome:
        """An OpenAI Responses request: read into the chat route's turn (see
        :mod:`~miles_tito.server.responses_request`), run and recorded exactly as a chat turn is.
        The response is remembered with its conversation, for a later ``previous_response_id``."""
        session = self._open(session_id)
        try:
            request = parse_responses_request(body)
            history = self._previous_conversation(session, request.previous_response_id)
            prompt, conversation = responses_request.chat_messages(request, history)
            turn = self._turn(session, prompt, request)
        except TitoError as exc:
            raise self._fail(session, exc) from None
        result = await self._run(session, turn)
        response_id = new_response_id()
        session.responses[response_id] = (*conversation, result.message)
        while len(session.responses) > RESPONSES_KEPT:
            session.responses.popitem(last=False)
        return ResponsesOutcome(request, result, response_id)

    @staticmethod
    def _previous_conversation(session: Session, response_id: str | None) -> tuple[ChatMessage, ...]:
        if response_id is None:
            return ()
        conversation = session.responses.get(response_id)
        if conversation is None:
            raise InvalidRequest(
                f"previous_response_id: no response {response_id!r} in this session (a session remembers its last "
                f"{RESPONSES_KEPT} responses); send the whole conversation as input instead",
                param="previous_response_id",
            )
        return conversation

    def _open(self, session_id: str) -> Session:
        session = self.get(session_id)
        if session.closing:
            raise SessionClosing(f"session {session_id} is being deleted; create a new session")
        return session

    async def _run(self, session: Session, turn: TurnRequest) -> TurnResult:
        """One turn under the session's lock (requests on one session run one after the other)."""
        async with session.lock:
            if session.closing:
                raise SessionClosing(f"session {session.id} was deleted while this request waited; create a new session")
            try:
                return await run_turn(
                    session.conversation, self.engine, turn, max_context_len=self.max_context_len, routing_key=session.id
                )
            except TitoError as exc:
                raise self._fail(session, exc) from None
            finally:
                session.last_used = time.monotonic()  # idle time counts from the end of a turn

    def _template_extra(self, request: ChatCompletionRequest) -> dict[str, Any] | None:
        extra = request.chat_template_kwargs
        if not extra:
            return None
        fixed = self.tito.family.template_kwargs
        clash = sorted(k for k in extra if k in fixed and extra[k] != fixed[k])
        if clash:
            raise InvalidRequest(
                f"chat_template_kwargs {clash} conflict with chat family {self.tito.family.name!r}, which sets "
                f"{ {k: fixed[k] for k in clash} } to keep its template prefix-invariant",
                param="chat_template_kwargs",
            )
        return dict(extra)

    @staticmethod
    def _fail(session: Session, error: TitoError) -> TitoError:
        if len(session.failures) == FAILURES_KEPT:
            session.failures_dropped += 1  # the deque drops the oldest as the new one comes in
        session.failures.append(RequestFailure(at=time.time(), status_code=error.status_code, code=error.code,
                                               message=error.message[:FAILURE_MESSAGE_CHARS]))
        return error


def conversation_view(conversation: Conversation, **session: Any) -> SessionView:
    """The state of ``conversation`` as its session's view; ``session``: the view's session-level
    fields (created_at, metadata, failures, closed, parent, children ...)."""
    family = conversation.tito.family
    episode = conversation.episode
    trajectory, trajectory_error = _trajectory([n.record for n in conversation.turns], family.max_trim_tokens)
    return SessionView(
        session_id=conversation.session_id,
        family=family.name,
        created_at=session.pop("created_at", time.time()),
        messages=[m.to_openai() for m in conversation.messages],
        token_ids=conversation.token_ids,
        records=list(conversation.records),
        max_trim_tokens=family.max_trim_tokens,
        trajectory=trajectory,
        trajectory_error=trajectory_error,
        episode_id=episode.id,
        role=conversation.role,
        head_turn=conversation.head.record.turn if conversation.head is not None else None,
        branches=[dataclasses.replace(b) for b in conversation.branches],  # a snapshot: a retry marks one later
        forks=episode.fork_counts(),
        episode_limit=episode.limit_hit,
        episode_limit_kind=episode.limit_kind,
        **session,
    )


def _validated(model: type[RequestModel], body: Any) -> RequestModel:
    try:
        return model.model_validate(body or {})
    except ValidationError as exc:
        error = exc.errors()[0]
        raise InvalidRequest(f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}") from None


def _trajectory(records: list[TurnRecord], max_trim_tokens: int) -> tuple[TrajectoryView | None, str | None]:
    if not any(not r.rolled_back for r in records):
        return None, None
    try:
        sample = assemble(records, max_trim_tokens=max_trim_tokens)
    except AssemblyError as exc:
        return None, str(exc)
    return TrajectoryView(
        tokens=sample.tokens, prompt_length=sample.prompt_length, response_length=sample.response_length,
        loss_mask=sample.loss_mask, rollout_logprobs=sample.rollout_logprobs, weight_versions=sample.weight_versions,
        token_versions=sample.token_versions,
        status=sample.status.value, exit_reason=sample.exit_reason.value if sample.exit_reason else None,
    ), None
