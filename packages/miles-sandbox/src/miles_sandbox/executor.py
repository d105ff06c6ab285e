"""The program that runs inside every sandbox (as ``python3 -I -S -c SOURCE``): standard library only.

It reads one JSON request per line on stdin and answers one JSON line on stdout:

* ``{"op": "ping"}`` -> ``{"ok": true}``: the pool's probe.
* ``{"op": "reset", "archive": b64}``: empty ``/workspace`` and ``/tmp``, unpack the template (a
  gzipped tar, base64) into ``/workspace``.
* ``{"op": "restore", "archive": b64}``: unpack over ``/workspace`` (files of the template put back).
* ``{"op": "exec", "command", "timeout_s", "max_output_bytes", "env", "cwd"}``: run
  ``/bin/sh -c command`` (the per-process limits, ``argv[1]`` as JSON, are this program's own,
  inherited), stdout and stderr merged, stop reading at
  ``max_output_bytes`` (the command is killed: a 1 GB output costs 1 MB), kill it at the wall
  deadline; then kill every other process of the sandbox (``kill(-1)``), so nothing started in the
  background outlives its command (or its episode).

The service never trusts what this program says beyond its shape: a command can kill or replace it
(same user), which costs that sandbox only (the pool sees a dead or wrong-speaking one and replaces it).
"""

import base64
import contextlib
import ctypes
import io
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tarfile
import time

WORKSPACE = "/workspace"
SCRATCH = "/tmp"
_PR_SET_DUMPABLE = 4


def _undumpable():
    # commands run as the same user: without this one could ptrace this program and answer for it
    with contextlib.suppress(OSError):
        ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def _empty(folder):
    for entry in os.listdir(folder):
        path = os.path.join(folder, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            for root, dirs, _ in os.walk(path):  # a command may have removed our own permissions
                for name in dirs:
                    os.chmod(os.path.join(root, name), 0o700)
            os.chmod(path, 0o700)
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def _unpack(archive):
    if not archive:
        return 0
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(archive)), mode="r:gz") as tar:
        members = tar.getmembers()
        # the service packed it (plain files and folders only), and this process can reach nothing
        # but the sandbox anyway; Debian 12's python3 predates extractall(filter=...)
        tar.extractall(WORKSPACE)
    return len(members)


def _kill_others():
    """SIGKILL every process of the sandbox but this one (and the namespace's init); a fork bomb
    may fork between two sweeps, so sweep until none is left."""
    for _ in range(200):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            break
        while True:  # reap our own children
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        time.sleep(0.005)


def _limit(limits):
    """Set the commands' limits on this process once: children inherit them (each with counters of
    its own), and a spawn without ``preexec_fn`` is ~4x faster (vfork instead of fork+exec)."""
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def _exec(request):
    command = request["command"]
    deadline = time.monotonic() + float(request["timeout_s"])
    cap = int(request["max_output_bytes"])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": WORKSPACE, "LANG": "C.UTF-8", "TMPDIR": SCRATCH,
           "PYTHONDONTWRITEBYTECODE": "1", **request.get("env", {})}
    cwd = os.path.normpath(os.path.join(WORKSPACE, request.get("cwd") or "."))
    started = time.monotonic()
    try:
        process = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
    except OSError as exc:  # e.g. the process limit is reached, or cwd is gone
        return {"returncode": -1, "output": "", "truncated": False, "timed_out": False,
                "seconds": time.monotonic() - started, "error": f"cannot start the command: {exc}"}
    chunks, size, truncated, timed_out = [], 0, False, False
    stream = process.stdout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([stream], [], [], min(left, 1.0))
        if not ready:
            continue
        data = os.read(stream.fileno(), 65536)
        if not data:
            break
        if size + len(data) > cap:
            chunks.append(data[: cap - size])
            size = cap
            truncated = True
            break
        chunks.append(data)
        size += len(data)
    if timed_out or truncated:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    stream.close()
    try:
        returncode = process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # its output closed but it still runs (it closed stdout)
        timed_out = True
        os.killpg(process.pid, signal.SIGKILL)
        returncode = process.wait()
    _kill_others()
    return {"returncode": returncode, "output": b"".join(chunks).decode("utf-8", "replace"), "truncated": truncated,
            "timed_out": timed_out, "seconds": time.monotonic() - started}


def _answer(request):
    op = request.get("op")
    if op == "ping":
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"ok": True, "cpu_s": usage.ru_utime + usage.ru_stime}  # our own, under RLIMIT_CPU too
    if op == "exec":
        return _exec(request)
    if op == "reset":
        _kill_others()
        _empty(WORKSPACE)
        _empty(SCRATCH)
        return {"ok": True, "files": _unpack(request.get("archive"))}
    if op == "restore":
        return {"ok": True, "files": _unpack(request.get("archive"))}
    return {"error": f"unknown op {op!r}"}


def main():
    _undumpable()
    _limit(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            answer = _answer(json.loads(line))
        except Exception as exc:  # one bad request costs that request
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
