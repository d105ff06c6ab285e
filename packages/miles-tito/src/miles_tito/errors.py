"""Errors of the TITO layer. Each carries the HTTP status and OpenAI-style ``code`` it maps to.

| status | code                            | when                                                          |
|--------|---------------------------------|---------------------------------------------------------------|
| 400    | ``invalid_request``             | malformed body, unsupported parameter, bad message            |
| 400    | ``role_not_allowed``            | an appended message's role is not allowed by the chat family  |
| 400    | ``context_length_exceeded``     | the prompt leaves no room for a single new token              |
| 400    | ``episode_limit``               | over the episode's branches, sessions or tokens               |
| 404    | ``session_not_found``           | unknown (or deleted) session id                               |
| 404    | ``turn_not_found``              | a sub-agent's parent turn that its session does not have      |
| 409    | ``session_closing``             | the session is being deleted                                  |
| 422    | ``template_not_prefix_invariant`` | appending messages re-rendered earlier ones differently     |
| 422    | ``token_chain_broken``          | a turn's tokens do not extend the previous turn's             |
| 422    | ``template_error``              | the chat template raised while rendering                      |
| 502    | ``engine_error``                | the engine or router failed or answered nonsense              |
| 503    | ``engine_aborted``              | the engine aborted the generation (e.g. a weight update)      |
"""

from __future__ import annotations


class TitoError(Exception):
    """Base class; ``status_code`` and ``code`` say how the server reports it."""

    status_code = 400
    code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(TitoError):
    pass


class RoleNotAllowed(TitoError):
    code = "role_not_allowed"


class ContextLengthExceeded(TitoError):
    code = "context_length_exceeded"


class SessionNotFound(TitoError):
    status_code = 404
    code = "session_not_found"


class TurnNotFound(TitoError):
    """A sub-agent's parent turn that its session does not have."""

    status_code = 404
    code = "turn_not_found"


class EpisodeLimitExceeded(TitoError):
    """The episode went over one of its limits (branches, sessions, tokens). A 400, not a 409 or
    429: the official SDKs retry those, and a retry can only go over again."""

    code = "episode_limit"


class SessionClosing(TitoError):
    status_code = 409
    code = "session_closing"


class TemplateNotPrefixInvariant(TitoError):
    status_code = 422
    code = "template_not_prefix_invariant"


class TokenChainBroken(TitoError):
    status_code = 422
    code = "token_chain_broken"


class TemplateFailed(TitoError):
    status_code = 422
    code = "template_error"


class EngineFailed(TitoError):
    status_code = 502
    code = "engine_error"


class EngineAborted(TitoError):
    status_code = 503
    code = "engine_aborted"
