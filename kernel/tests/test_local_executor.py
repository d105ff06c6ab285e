"""The local executor: health-checked start, death detection, restart, and no orphans ever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from miles.executor.local import LocalExecutor, ServiceError, free_port

SERVER = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1"]


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie still answers kill(0); treat a reaped-or-zombie child as gone
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_start_waits_for_health_and_shutdown_stops(tmp_path: Path) -> None:
    executor = LocalExecutor(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    executor.start("web", [*SERVER, str(port)], health_url=url)
    assert httpx.get(url).status_code == 200
    pid = executor.services()["web"].process.pid
    executor.shutdown()
    assert _wait_gone(pid)
    assert (tmp_path / "logs" / "web.log").is_file()


def test_service_that_dies_at_start_up_reports_its_log(tmp_path: Path) -> None:
    executor = LocalExecutor(tmp_path)
    argv = [sys.executable, "-c", "import sys; print('config is broken: no model'); sys.exit(3)"]
    with pytest.raises(ServiceError, match="exited with code 3 during start-up(.|\n)*config is broken: no model"):
        executor.start("bad", argv, health_url=f"http://127.0.0.1:{free_port()}/")
    executor.shutdown()


def test_death_is_detected_and_restart_brings_it_back(tmp_path: Path) -> None:
    executor = LocalExecutor(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    executor.start("web", [*SERVER, str(port)], health_url=url)
    seen: list[str] = []
    restarted = threading.Event()

    def on_death(name: str) -> None:
        seen.append(name)
        executor.restart(name)  # returns once the new process answers its health check
        restarted.set()

    executor.supervise(on_death, interval=0.2)
    first = executor.services()["web"].process.pid
    os.kill(first, signal.SIGKILL)
    assert restarted.wait(60)
    assert seen == ["web"]
    assert executor.services()["web"].restarts == 1
    assert executor.services()["web"].process.pid != first
    assert httpx.get(url, timeout=10).status_code == 200
    executor.shutdown()


def test_children_die_when_the_driver_is_killed(tmp_path: Path) -> None:
    port = free_port()
    driver = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from miles.executor.local import LocalExecutor
        ex = LocalExecutor(Path({str(tmp_path)!r}))
        ex.start("web", {SERVER + [str(port)]!r}, health_url="http://127.0.0.1:{port}/")
        print(ex.services()["web"].process.pid, flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)  # no cleanup code runs in the driver
    proc.wait()
    assert _wait_gone(child), "the service outlived its killed driver"


def test_launch_picks_the_port_sets_the_devices_and_restart_keeps_the_endpoint(tmp_path: Path) -> None:
    executor = LocalExecutor(tmp_path, gpus=["0", "3"])
    assert executor.nodes()[0].gpus == ("0", "3") and executor.reserve(1)[0].gpus == ("0",)

    def command(endpoint) -> list[str]:
        serve = (f"import os, http.server as h; print('devices', os.environ['CUDA_VISIBLE_DEVICES'], flush=True); "
                 f"h.HTTPServer(('127.0.0.1', {endpoint.port}), h.SimpleHTTPRequestHandler).serve_forever()")
        return [sys.executable, "-c", serve]

    endpoint = executor.launch("web", command, gpus=["3"], health_path="/")
    executor.wait_healthy("web")
    assert httpx.get(endpoint.url + "/").status_code == 200
    pid = executor.services()["web"].process.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while executor.alive("web") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert executor.returncode("web") == -signal.SIGKILL
    assert executor.restart("web") == endpoint  # same port, healthy again
    assert httpx.get(endpoint.url + "/").status_code == 200
    assert [row["gpus"] for row in executor.manifest()] == [["3"]]
    executor.shutdown()
    assert (tmp_path / "logs" / "web.log").read_text().count("devices 3") == 2


def test_a_service_restarted_from_a_thread_that_ended_keeps_running(tmp_path: Path) -> None:
    """Linux sends the parent-death signal when the *thread* that forked the child ends; the
    executor forks every child from one thread that lives as long as the process."""
    executor = LocalExecutor(tmp_path, startup_timeout=30)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    executor.start("web", [*SERVER, str(port)], health_url=url)
    try:
        helper = threading.Thread(target=executor.restart, args=("web",))  # e.g. a pool thread, or a one-off
        helper.start()
        helper.join()
        pid = executor.services()["web"].process.pid
        assert not _wait_gone(pid, timeout=3.0), "the service died with the thread that restarted it"
        assert httpx.get(url, timeout=10).status_code == 200
    finally:
        executor.shutdown()


def test_shutdown_signals_every_service_before_it_kills_any(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Services stop together: one deadline for all, not 5 s each in turn (three idle services of a
    run took 17-22 s to stop). These ignore SIGTERM, so each is killed after the grace."""
    from miles.executor import children

    sent: list[tuple[int, int]] = []
    signal_group = children._signal_group

    def recording(pgid: int, sig: int) -> bool:
        sent.append((pgid, sig))
        return signal_group(pgid, sig)

    monkeypatch.setattr(children, "_signal_group", recording)
    executor = LocalExecutor(tmp_path, startup_timeout=60)
    stubborn = ("import http.server as h, signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "h.HTTPServer(('127.0.0.1', int(sys.argv[1])), h.SimpleHTTPRequestHandler).serve_forever()")
    pids = []
    for i in range(3):
        port = free_port()
        executor.start(f"stubborn-{i}", [sys.executable, "-c", stubborn, str(port)], health_url=f"http://127.0.0.1:{port}/")
        pids.append(executor.services()[f"stubborn-{i}"].process.pid)
    executor.shutdown()
    assert all(_wait_gone(pid) for pid in pids)
    order = [sig for pgid, sig in sent if pgid in pids and sig != 0]
    assert order[:3] == [signal.SIGTERM] * 3 and order[3:6] == [signal.SIGKILL] * 3, order


def test_a_health_answer_from_another_program_on_the_picked_port_moves_the_service(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # another program (here a plain http.server in its own session, as another run's server would
    # be) listens on the port picked for the service before the service binds it: its 200 must not
    # pass for the service's health; the service is started again on another port
    taken = free_port()
    other = subprocess.Popen([*SERVER, str(taken)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{taken}/").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        import miles.executor.local as local

        picks = iter([taken])
        monkeypatch.setattr(local, "free_port", lambda host="127.0.0.1": next(picks, None) or free_port(host))

        def command(endpoint) -> list[str]:
            # a server that takes a moment before it binds (a real one imports its framework first)
            serve = (f"import time, sys, http.server as h; time.sleep(1.0)\n"
                     f"try:\n    s = h.HTTPServer(('127.0.0.1', {endpoint.port}), h.SimpleHTTPRequestHandler)\n"
                     f"except OSError:\n    sys.exit(98)\ns.serve_forever()")
            return [sys.executable, "-c", serve]

        executor = LocalExecutor(tmp_path)
        try:
            endpoint = executor.launch("web", command, health_path="/")
            assert endpoint.port == taken
            executor.wait_healthy("web")
            moved = executor.endpoint("web")
            assert moved.port != taken
            assert httpx.get(moved.url + "/").status_code == 200
            assert executor.alive("web") and other.poll() is None
            assert f"port {taken} was taken by another process" in (tmp_path / "logs" / "web.log").read_text()
        finally:
            executor.shutdown()
    finally:
        other.kill()
        other.wait()
