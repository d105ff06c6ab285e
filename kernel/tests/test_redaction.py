"""The redactor that stands between a process's output and its log: every secret of the run and
every session key becomes the marker, also when the output arrives cut at any byte; nothing else
changes, and nothing is held back that could not begin a secret. Then the same through a real
process started by the local executor, whose log is private."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

from miles.executor.local import LocalExecutor
from miles.redaction import MARKER, Redactor
from miles_contracts.wire.auth import new_session_key

TOKEN = "Zq0v4L6Xw2cT9bN1yH8eR5uJ3kP7sD0fG2hA4mQ6iEc"  # as new_token() makes them
SECRET = "S3cr3t-of-the-trainer-group-0123456789abcdef"


def _streamed(redactor: Redactor, data: bytes, cut: int) -> bytes:
    stream = redactor.stream()
    return stream.feed(data[:cut]) + stream.feed(data[cut:]) + stream.finish()


def test_each_secret_becomes_the_marker_wherever_the_output_is_cut() -> None:
    key = new_session_key()
    redactor = Redactor.for_environment({"MILES_AUTH_TOKEN": TOKEN}, {"MILES_TRAINER_SECRET": SECRET})
    data = f"args: --api-key {TOKEN}\nsecret={SECRET} key {key}, again {TOKEN}\nsmile\n".encode()
    expected = f"args: --api-key {MARKER}\nsecret={MARKER} key {MARKER}, again {MARKER}\nsmile\n".encode()
    assert redactor.data(data) == expected
    assert all(_streamed(redactor, data, cut) == expected for cut in range(len(data) + 1))


def test_only_what_could_begin_a_secret_waits_for_the_next_chunk() -> None:
    redactor = Redactor([TOKEN])
    stream = redactor.stream()
    assert stream.feed(b"loading weights\n") == b"loading weights\n"
    assert stream.feed(b"a key: " + TOKEN[:10].encode()) == b"a key: "  # could be the token: held
    assert stream.feed(b"!\n") == TOKEN[:10].encode() + b"!\n"  # was not: written with what follows
    assert stream.feed(b"cut off: " + TOKEN[:10].encode()) == b"cut off: "
    assert stream.finish() == MARKER.encode()  # the output ended inside the token: its start stays hidden
    ordinary = Redactor([TOKEN]).stream()
    assert ordinary.feed(b"a smile") == b"a s"  # "mile" could begin a session key ("miles-sk-...")
    assert ordinary.finish() == b"mile"  # but did not: it ends the output as printed


def test_short_and_absent_values_are_no_secrets() -> None:
    assert Redactor.for_environment({"MILES_AUTH_TOKEN": "1", "OTHER": TOKEN}).text(f"1 {TOKEN}") == f"1 {TOKEN}"
    assert Redactor().text("nothing to hide") == "nothing to hide"


def test_a_process_started_by_the_local_executor_logs_no_secret(tmp_path: Path) -> None:
    """A child that prints the token and the trainer secret it was given, in two writes each cut
    inside the secret: its log (0600, in a 0700 folder) has the marker in their place."""
    code = ("import os, sys; t, s = os.environ['MILES_AUTH_TOKEN'], os.environ['MILES_TRAINER_SECRET']; "
            "[(sys.stdout.write(x[:5]), sys.stdout.flush(), sys.stdout.write(x[5:] + chr(10)), sys.stdout.flush()) "
            "for x in (t, s)]; print('argv:', sys.argv[1:], flush=True)")
    executor = LocalExecutor(tmp_path / "run")
    try:
        executor.launch("child", lambda endpoint: [sys.executable, "-c", code, TOKEN],
                        env={"MILES_AUTH_TOKEN": TOKEN, "MILES_TRAINER_SECRET": SECRET})
        service = executor.services()["child"]
        assert service.process is not None and service.process.wait(timeout=60) == 0
        tail = service.log_tail()
    finally:
        executor.shutdown()
    log = tmp_path / "run" / "logs" / "child.log"
    text = log.read_text()
    assert TOKEN not in text and SECRET not in text and TOKEN not in tail and MARKER in tail
    assert text.splitlines()[-3:] == [MARKER, MARKER, f"argv: ['{MARKER}']"]
    assert f"-c {code} {MARKER}" in text  # the command line the executor wrote above it
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and stat.S_IMODE(log.parent.stat().st_mode) == 0o700
