"""What every Miles server process shares (``miles.server_process``), shown on small real processes:
a taken port ends the process with status 98 and a message naming the address, and the stop
deadline holds in the states where no Python thread can run any more."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time

from miles_contracts.cluster import EXIT_ADDRESS_IN_USE

STOP_WITHIN_S = 20.0  # generous: the deadline under test is 1 s (+1 s backstop) on a loaded machine


def _server(body: str) -> subprocess.Popen[str]:
    """A Python process running ``body`` under ``server_main``; it prints ``ready`` once its stop
    handling is installed."""
    script = textwrap.dedent("""
        import argparse, sys, time
        from miles.server_process import server_main, stop_within

        def run(args: argparse.Namespace) -> int:
        {body}

        sys.exit(server_main("test-server", "a test server", lambda parser: None, run, []))
    """).format(body=textwrap.indent(textwrap.dedent(body), "    "))
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(process: subprocess.Popen[str]) -> tuple[int, str]:
    """SIGTERM once it is ready; its exit status and stderr (it must end within STOP_WITHIN_S)."""
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"still running {STOP_WITHIN_S} s after SIGTERM; stderr:\n{err[-3000:]}") from None
    return process.returncode, err


def test_a_server_whose_port_is_taken_exits_98_naming_the_address() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        process = _server(f"""
            from miles.server_process import listen_socket
            listen_socket("127.0.0.1", {port})
            print("serving", flush=True)
            return 0
        """)
        out, err = process.communicate(timeout=120)
    assert process.returncode == EXIT_ADDRESS_IN_USE
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in err
    assert "serving" not in out


def test_a_stopped_server_ends_without_interpreter_finalization() -> None:
    """An engine spent 4-6 s in finalization (garbage-collecting torch) after a clean stop, where
    the deadline thread cannot run. Here an object whose finalizer takes a minute stands in."""
    process = _server("""
        class SlowToCollect:
            def __init__(self):
                self.cycle = self  # freed by the collector at finalization
            def __del__(self, sleep=time.sleep):
                sleep(60)
        SlowToCollect()
        stopped = []
        stop_within(30, lambda: stopped.append(True))
        print("ready", flush=True)
        while not stopped:
            time.sleep(0.01)
        return 7
    """)
    code, err = _stop(process)
    assert code == 7, err  # the status run() returned, and nothing of the finalizer's minute
    assert "still running" not in err


def test_the_deadline_holds_while_a_c_call_holds_the_gil() -> None:
    """After the signal, C code takes the GIL and keeps it (here a backtracking regular expression
    that would run for ages): the deadline thread cannot run, faulthandler's watchdog (a C thread)
    ends the process and shows where it was stuck."""
    process = _server("""
        import re
        stopped = []
        stop_within(1, lambda: stopped.append(True))
        print("ready", flush=True)
        while not stopped:
            time.sleep(0.01)
        re.match(r"(a+)+$", "a" * 64 + "b")
        return 0
    """)
    code, err = _stop(process)
    assert code == 1 and "Timeout (0:00:02)!" in err and "in run" in err, err[-2000:]


def test_the_deadline_ends_a_server_that_ignores_its_stop_request() -> None:
    started = time.monotonic()
    process = _server("""
        stop_within(1, lambda: None)  # asked to stop, the server goes on
        print("ready", flush=True)
        while True:
            time.sleep(0.1)
    """)
    code, err = _stop(process)
    assert code == 128 + signal.SIGTERM
    assert "miles: still running 1 s after the stop signal; exiting now" in err
    assert time.monotonic() - started < 120
