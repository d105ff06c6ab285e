"""A stand-in engine for ``miles bench session --engine-kind stub``: ``python -m miles_tito.bench.stub_engine
--model M --port P``.

It stands in for an engine ONLY so that the benchmark measures the session server's own cost: a
real engine's generation time (and its noise) would otherwise dwarf the fraction of a millisecond
the server adds. It is a real HTTP server on loopback, the session server's own stack (a plain ASGI
app on uvicorn, behind the run's :class:`~miles_contracts.wire.guard.RequestGuard`), and answers
``POST /generate`` at once with the engine's wire shape (:class:`~miles_contracts.wire.engine.GenerateResponse`):
the ids of :data:`REPLY` in ``--model``'s tokenizer, then the first of the request's
``stop_token_ids`` (finish reason ``stop``, as a turn that ends by itself), or the reply cut at
``max_new_tokens`` (finish reason ``length``); a log-prob per id when asked; weight version
``"default"``, as SGLang reports unchanged weights. The reply is plain text, no tool call, so the
server's parsing does the ordinary work of a text turn. ``GET /health`` answers 200; anything else 404.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from typing import Any

from miles_tito.server.app import acknowledge_lifespan

REPLY = "Hello there"
"""Two or three tokens in most tokenizers: with the stop id it fits the bench's 4-token budget."""
LOGPROB = -0.25

Send = Callable[[dict[str, Any]], Awaitable[None]]


class StubEngine:
    """The ASGI app. ``reply_ids`` are what every generation answers before its stop id;
    ``texts[n]`` is the text of the first ``n`` of them."""

    def __init__(self, reply_ids: list[int], texts: list[str]) -> None:
        self.reply_ids = reply_ids
        self.texts = texts
        self.served = 0

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]], send: Send) -> None:
        if scope["type"] == "lifespan":
            await acknowledge_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await _answer(send, 200, b"{}")
            return
        if scope["path"] != "/generate" or scope["method"] != "POST":
            await _answer(send, 404, b'{"detail":"Not Found"}')
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        try:
            request = json.loads(b"".join(chunks))
        except json.JSONDecodeError as exc:
            await _answer(send, 400, json.dumps({"detail": f"the body is not JSON: {exc.msg}"}).encode())
            return
        await _answer(send, 200, json.dumps(self.generate(request)).encode())

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """The answer to one ``/generate`` body."""
        self.served += 1
        params = request.get("sampling_params") or {}
        budget = params.get("max_new_tokens", 128)
        stop_ids = params.get("stop_token_ids") or []
        if stop_ids and budget > len(self.reply_ids):
            output_ids = [*self.reply_ids, stop_ids[0]]
            finish: dict[str, Any] = {"type": "stop", "matched": stop_ids[0]}
            text = self.texts[-1]  # SGLang's text leaves the stop id out
        else:
            output_ids = self.reply_ids[:budget]
            finish = {"type": "length", "length": len(output_ids)}
            text = self.texts[len(output_ids)]
        meta: dict[str, Any] = {
            "id": request.get("rid") or f"stub-{self.served}", "finish_reason": finish,
            "prompt_tokens": len(request.get("input_ids") or ()), "completion_tokens": len(output_ids),
            "cached_tokens": 0, "weight_version": "default", "e2e_latency": 0.0,
        }
        if request.get("return_logprob"):
            meta["output_token_logprobs"] = [[LOGPROB, token, None] for token in output_ids]
        return {"text": text, "output_ids": output_ids, "meta_info": meta}


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})



def stub_engine(model: str) -> StubEngine:
    """The stand-in for ``model``: :data:`REPLY` in its tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    return StubEngine(ids, [str(tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)])


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from miles.server_process import listen_socket
    from miles_contracts.wire.auth import ensure_run_token
    from miles_contracts.wire.guard import RequestGuard

    from miles_tito.bench.processes import model_path

    parser = argparse.ArgumentParser(prog="python -m miles_tito.bench.stub_engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-dense", help="whose tokenizer spells the reply")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    app = RequestGuard(stub_engine(model_path(args.model)), token=ensure_run_token())
    sock = listen_socket(args.host, args.port)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
