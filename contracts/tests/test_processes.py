"""``miles_contracts.testing.processes`` with real child processes: a small HTTP server (SERVER) that
takes its time in one of several ways before it serves, or never serves.

What a test relies on: a process that is slow but working is waited for, however long past the
stall window (its children's CPU and its log's growth count as work); a hung one is reported as
stalled, an exited one at once, one still working at the deadline as such, each with the tail of
its log; stopping it ends what it started.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from miles_contracts.testing.processes import LoggedProcess, NotReady, log_says, wait_ready

SERVER = r"""
import http.server, subprocess, sys, time
mode, port = sys.argv[1], int(sys.argv[2])
print("starting:", mode, flush=True)
if mode == "busy_child":  # the work happens in a child; this process only waits for it
    subprocess.run([sys.executable, "-c", "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end: pass"])
elif mode == "chatty":  # little CPU, but a line every 0.3 s
    for part in range(10):
        print("loading part", part, flush=True)
        time.sleep(0.3)
elif mode == "hang":
    print("waiting for a lock that nobody releases", flush=True)
    time.sleep(3600)
elif mode == "spin":
    while True:
        pass
elif mode == "fail":
    print("cannot load the model", file=sys.stderr, flush=True)
    sys.exit(3)
elif mode == "grandchild":
    helper = subprocess.Popen(["sleep", "3600"])
    print("helper", helper.pid, flush=True)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _server(mode: str, tmp_path: Path) -> tuple[LoggedProcess, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return LoggedProcess([sys.executable, "-c", SERVER, mode, str(port)], tmp_path / f"{mode}.log"), \
        f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("mode", ["busy_child", "chatty"])
def test_a_slow_process_that_is_working_is_waited_for_past_the_stall_window(mode: str, tmp_path: Path) -> None:
    """Both take longer than the 2 s stall window to serve: one uses CPU in a child it started, the
    other barely any CPU but keeps writing its log."""
    server, url = _server(mode, tmp_path)
    with server:
        server.wait_healthy(url, stall_s=2.0, deadline_s=300)
        assert "serving" in server.output()


def test_a_hung_process_is_reported_as_stalled_with_its_log(tmp_path: Path) -> None:
    server, url = _server("hang", tmp_path)
    with server, pytest.raises(NotReady) as error:
        server.wait_healthy(url, stall_s=2.0, deadline_s=300)
    assert error.value.reason == "stalled"  # long before the deadline
    message = str(error.value)
    assert f"answering {url}/health" in message and "no progress for" in message
    assert "waiting for a lock that nobody releases" in message  # the log's tail


def test_an_exited_process_is_reported_at_once_with_its_status_and_log(tmp_path: Path) -> None:
    server, url = _server("fail", tmp_path)
    with server, pytest.raises(NotReady) as error:
        server.wait_healthy(url, stall_s=300, deadline_s=300)
    assert error.value.reason == "exited"
    assert "exited with status 3" in str(error.value) and "cannot load the model" in str(error.value)


def test_a_process_still_working_at_the_deadline_is_reported_as_such(tmp_path: Path) -> None:
    server, url = _server("spin", tmp_path)
    with server, pytest.raises(NotReady) as error:
        server.wait_healthy(url, stall_s=300, deadline_s=3)
    assert error.value.reason == "deadline"
    assert "the deadline of 3 s passed" in str(error.value) and "starting: spin" in str(error.value)


def test_stop_ends_what_the_process_started_and_a_finished_run_gives_its_status(tmp_path: Path) -> None:
    server, url = _server("grandchild", tmp_path)
    with server:
        server.wait_healthy(url, stall_s=60)
        helper = int(server.output().split("helper ")[1].split()[0])
    wait_ready(lambda: not _running(helper), f"the helper {helper} to end", deadline_s=60)
    assert server.returncode is not None

    run = LoggedProcess([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(4)"],
                        tmp_path / "run.log").start()
    assert run.wait_exit("the run to finish") == 4
    assert set(run.output().split()) == {"out", "err"}  # stdout and stderr both in the log
    run.stop()
    assert log_says(tmp_path / "run.log", "err")()


def test_finished_returns_a_successful_run_s_output_and_fails_with_the_status_and_log_otherwise(tmp_path: Path) -> None:
    ok = LoggedProcess([sys.executable, "-c", "print('trained 2 steps')"], tmp_path / "ok.log").start()
    assert ok.finished("the good run to finish") == "trained 2 steps\n"
    failed = LoggedProcess([sys.executable, "-c", "import sys; print('no such model', file=sys.stderr); sys.exit(2)"],
                           tmp_path / "failed.log").start()
    with pytest.raises(NotReady) as error:
        failed.finished("the bad run to finish")
    assert error.value.reason == "failed"
    message = str(error.value)
    assert message.startswith("the bad run to finish: it exited with status 2\n") and "no such model" in message
    killed = LoggedProcess([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                           tmp_path / "killed.log").start()
    with pytest.raises(NotReady, match="it exited with signal SIGKILL"):
        killed.finished()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
