"""`TrainerGroup`: the driver's one handle on the trainer's rank processes.

The loop calls it where it would call a train backend (``compute_logprobs``, ``train_step``,
``save_checkpoint`` ...) plus ``push_weights``; each call goes to every rank (the backend is SPMD:
same arguments everywhere), and rank 0's result comes back. Weights never pass through the driver:
the ranks push them to the engines themselves (:mod:`miles.trainer.rank`).

The channel: the group listens on the executor's driver address (loopback for the local executor)
and every rank, started through the executor with its ``torchrun`` environment, connects back and
must present the group's secret (a fresh random token, compared in constant time) in its first
frame, read with a small size bound; the listener closes once every rank is in. Frames are JSON
plus raw tensor bytes (:mod:`miles.trainer.wire`): nothing received is unpickled. One connection
per rank works the same for a child on this machine and a process on another node of a Ray cluster
(docs/design/process-model.md says why not a pipe).

Failures: a rank whose connection ends, whose process dies, or that raises anything but a
:class:`~miles.errors.MilesError` leaves the others stuck in collectives, so the group is broken and
every later call raises :class:`TrainerRankError` naming the rank (the run stops; the executor
kills what is left). A :class:`~miles.errors.MilesError` on some rank while all ranks finished the
call (a refused weight sync) raises :class:`TrainerCallError` and the group stays usable.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_contracts import TransferReport

from miles.placement import Placement
from miles.trainer import wire
from miles.trainer.errors import TrainerCallError, TrainerRankError

_HELLO_LIMIT = 64 << 10  # bytes of header an unauthenticated peer may send
_HELLO_TIMEOUT = 10.0  # seconds an unauthenticated peer may take to send its hello


class TrainerGroup:
    """N trainer rank processes behind one SPMD handle (see the module docstring)."""

    def __init__(self, executor: Any, placement: Placement, config_data: Mapping[str, Any], *,
                 startup_timeout: float = 600.0, log_dir: Path | None = None, run_dir: Path | None = None) -> None:
        self.executor = executor
        self.placement = placement
        self.world_size = len(placement.trainer)
        self.names = [f"trainer-{rank}" for rank in range(self.world_size)]
        self.startup_timeout = startup_timeout
        self.log_dir = log_dir
        self._config_data = dict(config_data)
        self._run_dir = str(run_dir.resolve()) if run_dir is not None else None
        self._secret = secrets.token_urlsafe(32)
        self._socks: dict[int, socket.socket] = {}
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._accept_error: TrainerRankError | None = None
        self._broken: TrainerRankError | None = None
        self._closing = False
        self._ready = False
        self._lock = threading.Lock()
        self._next_id = 0

    # ------------------------------------------------------------------ start

    @classmethod
    def launch(cls, config: Any, executor: Any, placement: Placement, run_dir: Path) -> TrainerGroup:
        """Start every rank process and begin accepting them; returns at once (model loading in the
        ranks overlaps whatever the driver starts next). :meth:`wait_ready` finishes the start."""
        group = cls(executor, placement, config.to_dict(), startup_timeout=config.executor.startup_timeout,
                    log_dir=run_dir / "logs", run_dir=run_dir)
        try:
            group._start()
        except BaseException:
            group.close()
            raise
        return group

    def _start(self) -> None:
        host = self.executor.driver_address()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(self.world_size)
        address = f"[{host}]" if family == socket.AF_INET6 else host
        address = f"{address}:{self._listener.getsockname()[1]}"
        local_ranks = self.placement.local_ranks()
        per_node: dict[str, int] = {}
        for slot in self.placement.trainer:
            per_node[slot.node.name] = per_node.get(slot.node.name, 0) + 1
        master_port = 0
        for rank, slot in enumerate(self.placement.trainer):
            env = {
                "RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(local_ranks[rank]),
                "LOCAL_WORLD_SIZE": str(per_node[slot.node.name]), "MASTER_ADDR": self.placement.trainer[0].node.address,
                "MILES_TRAINER_ADDRESS": address, "MILES_TRAINER_SECRET": self._secret,
            }
            if not slot.gpus and self.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
                # CPU ranks share the machine's cores rather than each taking all of them
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // per_node[slot.node.name]))

            def command(endpoint: Any, rank: int = rank, master: int = master_port) -> list[str]:
                port = endpoint.port if rank == 0 else master  # rank 0 serves the rendezvous on its port
                return [sys.executable, "-m", "miles.trainer.rank", "--master-port", str(port)]

            endpoint = self.executor.launch(self.names[rank], command, node=slot.node.name, gpus=slot.gpus, env=env)
            if rank == 0:
                master_port = endpoint.port
        self._accepter = threading.Thread(target=self._accept_all, name="miles-trainer-accept", daemon=True)
        self._accepter.start()

    def _accept_all(self) -> None:
        """Take each rank's connection once it proves the secret, and send it ``init`` at once."""
        assert self._listener is not None
        self._listener.settimeout(0.5)
        init = wire.Frame({"kind": "call", "id": 0, "method": "init"}, {"config": self._config_data, "run_dir": self._run_dir})
        deadline = time.monotonic() + self.startup_timeout
        while len(self._socks) < self.world_size and not self._closing:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                dead = next((r for r, n in enumerate(self.names) if r not in self._socks and not self.executor.alive(n)), None)
                if dead is not None:
                    self._accept_error = self._died(dead, "start-up")
                    return
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if r not in self._socks]
                    self._accept_error = TrainerRankError(
                        f"trainer rank(s) {missing} did not connect within {self.startup_timeout:.0f} s; "
                        f"see {self._log(missing[0])}", missing[0])
                    return
                continue
            except OSError:
                return  # the listener was closed
            rank = self._authenticate(conn)
            if rank is None:
                conn.close()
                continue
            self._socks[rank] = conn
            with contextlib.suppress(OSError):  # a rank that died is reported when init replies are gathered
                init.send(conn)

    def _authenticate(self, conn: socket.socket) -> int | None:
        """The rank number a connection proved with the run's secret, or None. Nothing a peer
        sends here may stop the accept loop: the listener can be reachable from the cluster."""
        conn.settimeout(_HELLO_TIMEOUT)
        try:
            hello = wire.receive(conn, max_header=_HELLO_LIMIT, max_payload=0)
        except (wire.WireError, OSError, ValueError, TypeError, RecursionError):
            return None
        secret = hello.get("secret")
        rank = hello.get("rank")
        if (hello.get("kind") != "hello" or not isinstance(secret, str)
                or not hmac.compare_digest(secret.encode(), self._secret.encode())):
            return None
        if not isinstance(rank, int) or not 0 <= rank < self.world_size or rank in self._socks:
            return None
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return rank

    def wait_ready(self) -> None:
        """Block until every rank connected and built its backend; raises :class:`TrainerRankError`."""
        assert self._accepter is not None
        self._accepter.join()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._accept_error is not None:
            self._broken = self._accept_error
            raise self._accept_error
        with self._lock:
            self._gather(0, "init")
        self._ready = True

    # ------------------------------------------------------------------ the backend's calls

    def compute_logprobs(self, batch: Any, *, model: str = "actor") -> Any:
        return self._call("compute_logprobs", batch=batch, model=model)

    def compute_values(self, batch: Any) -> Any:
        return self._call("compute_values", batch=batch)

    def train_step(self, batch: Any) -> dict[str, float]:
        metrics: dict[str, float] = self._call("train_step", batch=batch)
        return metrics

    def save_checkpoint(self, path: Path, extra_state: Mapping[str, Any]) -> None:
        self._call("save_checkpoint", path=Path(path), extra_state=dict(extra_state))

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        extra: dict[str, Any] = self._call("load_checkpoint", path=Path(path))
        return extra

    def export_hf(self, path: Path) -> None:
        self._call("export_hf", path=Path(path))

    def push_weights(self, targets: Sequence[str], version: int) -> TransferReport:
        """Push the trainer's weights to engine ``i`` at ``targets[i]`` (from the rank placement
        names as its sender) and set their weight version; one report for the whole sync."""
        by_rank: dict[str, list[str]] = {}
        for index, url in enumerate(targets):
            by_rank.setdefault(str(self.placement.pushers[index]), []).append(url)
        reports = [r for r in self._call("push_weights", gather=True, targets=by_rank, version=version).values() if r]
        if not reports:
            raise TrainerCallError(f"no trainer rank pushed weights of version {version} (targets {list(targets)})")
        return TransferReport(
            version=version, num_tensors=max(r.num_tensors for r in reports), num_bytes=sum(r.num_bytes for r in reports),
            seconds=max(r.seconds for r in reports), num_buckets=max(r.num_buckets for r in reports),
            paused_seconds=max(r.paused_seconds for r in reports),
            checked_engines=tuple(sorted({url for r in reports for url in r.checked_engines})),
        )

    # ------------------------------------------------------------------ processes

    def owns(self, name: str) -> bool:
        return name in self.names

    def rank_died(self, name: str) -> TrainerRankError | None:
        """Record that rank process ``name`` died (the executor's supervisor saw it); the error to
        stop the run with, or None while the group is closing."""
        if self._closing:
            return None
        error = self._died(self.names.index(name), "the run")
        self._broken = self._broken or error
        return error

    def close(self, timeout: float = 120.0) -> None:
        """Let every rank close its backend and exit (skipped when the group is broken: the
        executor's shutdown ends the processes)."""
        self._closing = True
        if self._accepter is not None:
            self._accepter.join(timeout=5)
        if self._ready and self._broken is None:
            try:
                self._call("close", deadline=time.monotonic() + timeout)
            except (TrainerRankError, TrainerCallError) as exc:
                print(f"miles: closing the trainer ranks: {exc}", file=sys.stderr)
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # ------------------------------------------------------------------ calls

    def _call(self, method: str, *, gather: bool = False, deadline: float | None = None, **args: Any) -> Any:
        if self._broken is not None:
            raise self._broken
        with self._lock:
            self._next_id += 1
            frame = wire.Frame({"kind": "call", "id": self._next_id, "method": method}, args)
            for rank in range(self.world_size):
                try:
                    frame.send(self._socks[rank])
                except OSError:
                    self._fail(self._died(rank, method))
            results = self._gather(self._next_id, method, deadline)
        return results if gather else results[0]

    def _gather(self, call_id: int, method: str, deadline: float | None = None) -> dict[int, Any]:
        """Every rank's reply to call ``call_id``; fails fast when a rank dies or breaks."""
        results: dict[int, Any] = {}
        refused: dict[int, dict[str, Any]] = {}
        with selectors.DefaultSelector() as selector:
            for rank, sock in self._socks.items():
                selector.register(sock, selectors.EVENT_READ, rank)
            pending = set(self._socks)
            while pending:
                events = selector.select(timeout=1.0)
                for key, _ in events:
                    rank = key.data
                    reply = self._receive(rank, method)
                    if reply.get("id") != call_id:
                        self._fail(TrainerRankError(f"trainer rank {rank} answered call {reply.get('id')} "
                                                    f"while {method} (call {call_id}) was expected", rank))
                    pending.discard(rank)
                    selector.unregister(key.fileobj)
                    if reply.get("ok"):
                        results[rank] = reply.get("value")
                    elif reply.get("miles_error"):
                        refused[rank] = reply
                    else:
                        self._fail(self._blame(rank, method, reply))
                if not events:
                    for rank in sorted(pending):
                        if not self.executor.alive(self.names[rank]):
                            self._fail(self._died(rank, method))
                    if deadline is not None and time.monotonic() > deadline:
                        self._fail(TrainerRankError(f"trainer rank(s) {sorted(pending)} did not finish {method} in time",
                                                    min(pending)))
        if refused:
            lines = [f"rank {r}: {reply.get('error')}" for r, reply in sorted(refused.items())]
            raise TrainerCallError(f"{method} failed on {len(refused)} trainer rank(s):\n  " + "\n  ".join(lines))
        return results

    def _receive(self, rank: int, method: str) -> dict[str, Any]:
        try:
            return wire.receive(self._socks[rank])
        except (wire.WireError, OSError):
            self._fail(self._died(rank, method))
            raise  # unreachable: _fail raises

    def _blame(self, rank: int, method: str, reply: dict[str, Any]) -> TrainerRankError:
        """The error for ``rank``'s failed reply -- unless another rank died: a collective then
        fails on the survivors first, and the dead rank is the one to name."""
        failure = f"{reply.get('error')}\n{reply.get('traceback', '').rstrip()}"
        deadline = time.monotonic() + 3.0
        while True:
            for other, name in enumerate(self.names):
                if other != rank and not self.executor.alive(name):
                    error = self._died(other, method)
                    return TrainerRankError(f"{error}\n(rank {rank} then failed: {reply.get('error')})", other)
            if time.monotonic() > deadline:
                return TrainerRankError(f"trainer rank {rank} failed in {method}: {failure}", rank)
            time.sleep(0.2)

    def _fail(self, error: TrainerRankError) -> None:
        self._broken = self._broken or error
        raise error

    def _died(self, rank: int, during: str) -> TrainerRankError:
        name = self.names[rank]
        code = None
        deadline = time.monotonic() + 5.0  # the connection may end a moment before the process does
        while time.monotonic() < deadline:
            if not self.executor.alive(name):
                code = self.executor.returncode(name)
                break
            time.sleep(0.1)
        return TrainerRankError(f"trainer rank {rank} ({name}) died during {during}{_exit_status(code)}; "
                                f"its log: {self._log(rank)}", rank)

    def _log(self, rank: int) -> str:
        return str(self.log_dir / f"{self.names[rank]}.log") if self.log_dir is not None else self.names[rank]


def _exit_status(code: int | None) -> str:
    if code is None:
        return ""
    if code < 0:
        try:
            return f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f" (killed by signal {-code})"
    return f" (exit code {code})"


__all__ = ["TrainerGroup"]
