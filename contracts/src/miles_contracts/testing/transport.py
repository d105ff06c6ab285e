"""Conformance suite for weight transports: ``check_weight_transport(transport, engine_urls, tensors)``.

What a transport must do, checked against real engines that serve the engine API plus its two
check-mode endpoints (``POST /fill_weights_noise``, ``GET /weights_checksum``):

1. Every engine's weights are first filled with noise (and the suite confirms the noise landed, or
   the rest would prove nothing).
2. One ``push`` of the trainer's tensors restores every sent tensor bit-exactly on every engine
   (SHA-256 of the raw bytes), and no engine tensor keeps its noise (a tied ``lm_head`` is restored
   through its embedding and so passes).
3. Afterwards every engine reports ``weight_version == version``, still generates, and tags its
   output with that version; with ``reference_url`` (an engine loaded from the same weights), its
   greedy output equals the reference's token for token.
4. The :class:`~miles_contracts.weights.TransferReport` counts exactly the tensors and bytes sent.
5. A second push bumps the version again and keeps the weights exact.

``tensors`` must be in the engines' dtype (a bf16 engine rounds fp32 input, and then no transport
can be bit-exact). The suite pushes generators, never lists, so a transport must make one pass.
Only the standard library is used for HTTP; torch is imported lazily.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from miles_contracts.wire.auth import auth_headers

if TYPE_CHECKING:
    import torch

    from miles_contracts.protocols import WeightTransport

NOISE_SEED = 20240611
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # engines are never behind HTTP_PROXY


def _checksum(tensor: torch.Tensor) -> str:
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(raw.numpy().data).hexdigest()


def _call(url: str, path: str, body: dict[str, Any] | None = None, *, timeout: float = 300.0) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json", **auth_headers()})
    try:
        with _DIRECT.open(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"engine {url}{path} answered HTTP {exc.code}: {exc.read()[:500]!r}") from exc
    except urllib.error.URLError as exc:
        raise AssertionError(f"engine {url} is unreachable for {path}: {exc.reason}") from exc
    return json.loads(raw) if raw else {}


def _fail(message: str) -> None:
    raise AssertionError(message)


def _checksums(url: str) -> tuple[str, dict[str, str]]:
    answer = _call(url, "/weights_checksum")
    if not isinstance(answer.get("checksums"), dict) or not answer["checksums"]:
        _fail(f"engine {url}: GET /weights_checksum must answer {{weight_version, checksums: {{name: sha256}}}}, got {answer!r:.300}")
    return str(answer.get("weight_version")), answer["checksums"]


def _greedy(url: str, prompt_ids: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
    answer = _call(url, "/generate", {
        "input_ids": list(prompt_ids), "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    })
    if not answer.get("output_ids"):
        _fail(f"engine {url} generated nothing after the sync: {answer!r:.300}")
    return answer


def _expect_exact(url: str, sent: dict[str, str], noise: dict[str, str], version: int, when: str) -> None:
    reported, held = _checksums(url)
    if reported != str(version):
        _fail(f"engine {url} reports weight_version {reported!r} {when}, expected {str(version)!r}")
    missing = [n for n in sent if n not in held]
    differ = [n for n in sent if n in held and held[n] != sent[n]]
    still_noise = [n for n, d in held.items() if n not in sent and noise.get(n) == d]
    if missing or differ or still_noise:
        _fail(f"engine {url} {when} is not bit-exact: differ={differ[:8]} missing={missing[:8]} "
              f"never restored (still noise)={still_noise[:8]}")


def check_weight_transport(transport: WeightTransport, engine_urls: Sequence[str] | str,
                           tensors: Sequence[tuple[str, torch.Tensor]], *, version: int = 1,
                           reference_url: str | None = None, prompt_ids: Sequence[int] = (1, 2, 3, 4, 5, 6, 7, 8),
                           max_new_tokens: int = 8) -> None:
    """Run the suite; raises ``AssertionError`` naming the first broken rule.

    :param transport: the transport under test (not closed by the suite).
    :param engine_urls: base URLs of running engines that serve the model ``tensors`` belong to.
    :param tensors: the trainer's ``(hf_name, tensor)`` pairs, in the engines' dtype.
    :param version: the version of the first push (the second is ``version + 1``).
    :param reference_url: an engine loaded from the same weights, for a greedy-output comparison.
    """
    urls = [engine_urls] if isinstance(engine_urls, str) else list(engine_urls)
    urls = [u.rstrip("/") for u in urls]
    tensors = list(tensors)
    sent = {name: _checksum(t) for name, t in tensors}
    num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)

    noise: dict[str, dict[str, str]] = {}
    for url in urls:
        _call(url, "/fill_weights_noise", {"seed": NOISE_SEED})
        _, noise[url] = _checksums(url)
        unchanged = [n for n in sent if noise[url].get(n) == sent[n]]
        if unchanged:
            _fail(f"engine {url}: /fill_weights_noise left {unchanged[:8]} unchanged; the suite could not tell a sync from none")

    for attempt, current in enumerate((version, version + 1)):
        report = transport.push(((n, t) for n, t in tensors), targets=urls, version=current)
        when = "after the first push" if attempt == 0 else "after a second push"
        if report.version != current:
            _fail(f"TransferReport.version is {report.version}, pushed {current}")
        if report.num_tensors != len(tensors) or report.num_bytes != num_bytes:
            _fail(f"TransferReport counts {report.num_tensors} tensors / {report.num_bytes} bytes, "
                  f"sent {len(tensors)} / {num_bytes}")
        if not report.seconds > 0 or report.num_buckets < 1 or not 0 <= report.paused_seconds <= report.seconds:
            _fail(f"TransferReport is inconsistent: {report!r}")
        for url in urls:
            _expect_exact(url, sent, noise[url], current, when)
            answer = _greedy(url, prompt_ids, max_new_tokens)
            tagged = str(answer.get("meta_info", {}).get("weight_version"))
            if tagged != str(current):
                _fail(f"engine {url} tags its output with weight_version {tagged!r} {when}, expected {str(current)!r}")
            if reference_url is not None:
                expected = _greedy(reference_url.rstrip("/"), prompt_ids, max_new_tokens)
                if answer["output_ids"] != expected["output_ids"]:
                    _fail(f"engine {url} {when} generates {answer['output_ids']}, but an engine loaded from the same "
                          f"weights generates {expected['output_ids']}")
