"""One trainer rank: a process that runs the train backend and answers the driver's calls.

Started by :class:`miles.trainer.group.TrainerGroup` through the executor, like ``torchrun`` starts
ranks (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in the
environment), plus where the driver listens (``MILES_TRAINER_ADDRESS``) and the group's secret
(``MILES_TRAINER_SECRET``). It connects, proves the secret, and serves calls one at a time until
``close`` or until the driver goes away. Every rank gets every call (the backend is SPMD); only
rank 0 sends its result back, except for the calls in :data:`GATHERED`.

Weight sync runs here: each rank that the placement names as an engine's sender pushes with the
configured weight transport; every rank iterates ``named_weights()`` to the end, also when a push
fails, so collectives stay in step.

    python -m miles.trainer.rank --master-port PORT
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_contracts import Process, RunContext, WeightTransport

from miles.errors import MilesError
from miles.trainer import wire
from miles.trainer.device import hand_back_cached_memory

GATHERED = frozenset({"push_weights", "init"})
"""Calls whose result every rank sends (the driver combines them)."""


class _Drained:
    """``named_weights()`` that can be iterated to the end after its consumer stopped early."""

    def __init__(self, weights: Iterator[Any]) -> None:
        self._weights = iter(weights)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return next(self._weights)

    def drain(self) -> None:
        for _ in self._weights:
            pass


class RankWorker:
    """The backend of this rank and the calls the driver may make on it (and only those)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.backend: Any = None
        self.ctx: RunContext | None = None
        self._transport: WeightTransport | None = None

    def init(self, config: Mapping[str, Any], run_dir: str | None = None) -> dict[str, Any]:
        """Load the run's plugins and build the backend, as ``train.backend`` names it."""
        from miles.config import build_config
        from miles.kernel import Kernel

        built = build_config(config)
        kernel = Kernel.load(built.plugin_selection)
        self.ctx = ctx = RunContext(built, kernel, Process.trainer_rank(self.rank), Path(run_dir) if run_dir else None)
        kernel.configure(ctx)
        self.backend = kernel.train_backends().get(built.train.backend).create(ctx)
        return {"pid": os.getpid(), "host": socket.gethostname()}

    @property
    def context(self) -> RunContext:
        if self.ctx is None:
            raise MilesError("trainer rank not initialised: the driver's first call must be init")
        return self.ctx

    def compute_logprobs(self, batch: Any, model: str = "actor") -> Any:
        return self.backend.compute_logprobs(batch, model=model)

    def compute_values(self, batch: Any) -> Any:
        return self.backend.compute_values(batch)

    def train_step(self, batch: Any) -> dict[str, float]:
        metrics = dict(self.backend.train_step(batch))
        self.context.kernel.train_step_end(metrics)  # plugins measuring inside the backend report here
        if self.context.config.run.weights_digest:  # every rank iterates: a sharded backend gathers collectively
            from miles.trainer.weights_digest import weights_digest

            metrics["train/weights_digest"] = weights_digest(self.backend.named_weights())
        if self.context.config.resources.release_engine_memory != "none":
            # the engines released memory for this step and take it back next: leave it free for them
            hand_back_cached_memory()
        return metrics

    def save_checkpoint(self, path: Path, extra_state: Mapping[str, Any]) -> None:
        self.backend.save_checkpoint(path, extra_state)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        extra: dict[str, Any] = self.backend.load_checkpoint(path)
        return extra

    def export_hf(self, path: Path) -> None:
        self.backend.export_hf(path)

    def push_weights(self, targets: Mapping[str, Sequence[str]], version: int) -> Any:
        """Push to the engines assigned to this rank (if any); returns the transport's report."""
        mine = list(targets.get(str(self.rank), ()))
        weights = _Drained(self.backend.named_weights())
        try:
            if not mine:
                return None
            first = next(weights, None)
            if first is None:  # pushing nothing would leave the engines' old weights under the new version
                raise MilesError(f"trainer rank {self.rank} must push weights to {mine} but its backend yielded "
                                 f"none (a backend that gathers weights on rank 0 only needs rank 0 to push: "
                                 f"resources.colocate=false)")
            return self._weight_transport().push(itertools.chain([first], weights), targets=mine, version=version)
        finally:
            weights.drain()

    def close(self) -> None:
        for closer in (self._transport, self.backend):  # both protocols declare close()
            if closer is not None:
                closer.close()
        self._transport = self.backend = None

    def _weight_transport(self) -> WeightTransport:
        if self._transport is None:
            ctx = self.context
            self._transport = ctx.kernel.weight_transports().get(ctx.config.weights.transport).create(ctx)
        return self._transport


CALLS: dict[str, Callable[..., Any]] = {
    "init": RankWorker.init,
    "compute_logprobs": RankWorker.compute_logprobs,
    "compute_values": RankWorker.compute_values,
    "train_step": RankWorker.train_step,
    "save_checkpoint": RankWorker.save_checkpoint,
    "load_checkpoint": RankWorker.load_checkpoint,
    "export_hf": RankWorker.export_hf,
    "push_weights": RankWorker.push_weights,
    "close": RankWorker.close,
}


def serve(sock: socket.socket, worker: RankWorker) -> None:
    """Answer calls until ``close`` or until the driver closes the connection."""
    while True:
        try:
            message = wire.receive(sock)
        except wire.PeerClosed:
            return
        method = message.get("method")
        reply = {"kind": "reply", "id": message.get("id"), "method": method}
        try:
            call: Callable[..., Any] | None = CALLS.get(method) if isinstance(method, str) else None
            if call is None:
                raise ValueError(f"unknown trainer call {method!r}; calls: {', '.join(CALLS)}")
            args = message.get("value") or {}
            result = call(worker, **args)
            frame = wire.Frame({**reply, "ok": True}, result if worker.rank == 0 or method in GATHERED else None)
        except BaseException as exc:  # sent to the driver, which decides what it means
            frame = wire.Frame({**reply, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc(), "miles_error": isinstance(exc, MilesError)})
        frame.send(sock)
        if method == "close":
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles.trainer.rank", description=__doc__.split("\n\n")[0])
    parser.add_argument("--master-port", type=int, required=True, help="rank 0's port for the process group rendezvous")
    args = parser.parse_args(argv)
    os.environ["MASTER_PORT"] = str(args.master_port)
    secret = os.environ.pop("MILES_TRAINER_SECRET", "")  # not inherited by anything this rank starts
    host, _, port = os.environ["MILES_TRAINER_ADDRESS"].rpartition(":")
    rank = int(os.environ.get("RANK", "0"))
    with socket.create_connection((host.strip("[]"), int(port)), timeout=60) as sock:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        wire.send(sock, {"kind": "hello", "rank": rank, "secret": secret, "pid": os.getpid()})
        worker = RankWorker(rank)
        try:
            serve(sock, worker)
        finally:
            worker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
