"""The ``remote`` reward: score samples with an HTTP endpoint (``reward.remote_url``).

One POST per batch::

    request:  {"samples": [{"prompt": ..., "response": ..., "label": ..., "metadata": {...}}, ...]}
    response: {"rewards": [1.0, 0.0, null, ...]}   (or a bare JSON list; null = cannot score)

A sample that is a branch of an episode also sends its ``"role"`` and the episode's ``"roles"``;
the answer may then score it ``{"<role>": 1.0, ...}`` (per-role rewards, checked per sample by
:func:`miles.rewards.score_samples`).

Any failure -- connection refused, timeout, an HTTP error status, a malformed answer -- raises
:class:`RemoteRewardError` with the URL and what went wrong; :func:`miles.rewards.score_samples` then
marks the affected samples, not the run.
"""

from __future__ import annotations

import functools
import json
import math
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_contracts import Sample

from miles.errors import MilesError

if TYPE_CHECKING:
    from miles_contracts import RunContext


class RemoteRewardError(MilesError):
    """The reward endpoint could not be reached or answered something unusable."""


@dataclass(frozen=True, slots=True)
class RemoteReward:
    """Posts batches to ``url``. Registered unbound; :meth:`bind` gives it the run's config."""

    url: str | None = None
    timeout: float = 30.0

    def bind(self, ctx: RunContext) -> RemoteReward:
        """This run's remote reward (``reward.remote_url``, ``reward.timeout``)."""
        config = ctx.config.reward
        return RemoteReward(url=config.remote_url, timeout=config.timeout)

    async def __call__(self, samples: Sequence[Sample]) -> list[float | dict[str, Any]]:
        if not samples:
            return []
        if not self.url:
            raise RemoteRewardError(
                "the remote reward has no endpoint: set reward.remote_url (e.g. reward.remote_url=http://127.0.0.1:8000/score)"
            )
        import httpx

        from miles.loopback import is_loopback_url

        body = json.dumps({"samples": [_payload(s) for s in samples]}, default=str)
        try:
            # a remote server may need the environment's proxy; a loopback one never does
            async with httpx.AsyncClient(timeout=self.timeout, verify=_tls_context(),
                                         trust_env=not is_loopback_url(self.url)) as client:
                response = await client.post(self.url, content=body, headers={"content-type": "application/json"})
        except httpx.TimeoutException:
            raise RemoteRewardError(f"reward endpoint {self.url} did not answer within {self.timeout} s (reward.timeout)") from None
        except httpx.HTTPError as exc:
            raise RemoteRewardError(f"cannot reach reward endpoint {self.url}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 400:
            raise RemoteRewardError(f"reward endpoint {self.url} answered HTTP {response.status_code}: {response.text[:500]}")
        return _parse_rewards(self.url, response.text, len(samples))


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """Built once: loading the CA bundle costs ~0.2 s, which a client per batch would pay each time.
    Honours ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` like httpx does."""
    import certifi

    cafile = os.environ.get("SSL_CERT_FILE") or (None if os.environ.get("SSL_CERT_DIR") else certifi.where())
    return ssl.create_default_context(cafile=cafile, capath=os.environ.get("SSL_CERT_DIR"))


def _payload(sample: Sample) -> dict[str, Any]:
    payload: dict[str, Any] = {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
                               "metadata": sample.metadata}
    if sample.branch is not None:  # one agent of an episode: the endpoint may score every role
        roles = {b.branch.role for b in (sample, *sample.branches) if b.branch is not None}
        payload |= {"role": sample.branch.role, "roles": sorted(roles)}
    return payload


def _parse_rewards(url: str, text: str, expected: int) -> list[float | dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise RemoteRewardError(f"reward endpoint {url} answered with non-JSON: {text[:200]!r}") from None
    rewards = data.get("rewards") if isinstance(data, dict) else data
    if not isinstance(rewards, list):
        raise RemoteRewardError(f"reward endpoint {url} must answer {{\"rewards\": [...]}} or a JSON list; got {text[:200]!r}")
    if len(rewards) != expected:
        raise RemoteRewardError(f"reward endpoint {url} returned {len(rewards)} rewards for {expected} samples")
    scores: list[float | dict[str, Any]] = []
    for i, value in enumerate(rewards):
        if value is None:
            scores.append(math.nan)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            scores.append(float(value))
        elif isinstance(value, dict):  # per-role rewards: their values are checked with the sample's role
            scores.append(value)
        else:
            raise RemoteRewardError(f"reward endpoint {url} returned {value!r} for sample {i}; expected a number, "
                                    f"null or {{role: number}}")
    return scores
