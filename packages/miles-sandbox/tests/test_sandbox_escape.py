"""Escape attempts against a real bubblewrap sandbox, through the service's HTTP API: each one is
contained and comes back as a tool result that says what happened."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from miles_sandbox.client import Lease, SandboxClient


@pytest.fixture
def box(sandbox_url: str, token: str) -> Iterator[Lease]:
    client = SandboxClient(sandbox_url, token=token)
    with client.lease("adder") as lease:
        yield lease
    client.close()


def test_no_network(box: Lease) -> None:
    result = box.execute("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\"")
    assert result["returncode"] != 0
    assert "Network is unreachable" in result["output"]
    listing = box.execute("cat /proc/net/dev")
    assert [line.split(":")[0].strip() for line in listing["output"].splitlines()[2:]] == ["lo"]


def test_writes_outside_the_workspace_fail(box: Lease, tmp_path: os.PathLike[str]) -> None:
    result = box.execute("echo pwned > /usr/pwned; echo pwned > /etc/pwned; echo ok > /workspace/mine && cat mine")
    assert "Read-only file system" in result["output"]
    assert result["output"].strip().endswith("ok")
    assert not os.path.exists("/usr/pwned") and not os.path.exists("/etc/pwned")


def test_host_files_and_the_token_are_out_of_reach(box: Lease, token: str, sandbox_url: str,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    run_dir = tmp_path_factory.getbasetemp()
    result = box.execute(f"ls /root; ls {os.getcwd()}; cat {run_dir}/run*/token; cat /proc/1/environ; env; "
                         "cat /proc/*/environ 2>/dev/null; grep -rs MILES_AUTH_TOKEN /etc /tmp /workspace; echo done",
                         timeout_s=5)
    assert token not in result["output"]
    assert "cannot access '/root'" in result["output"] and f"{run_dir}/run" in result["output"]
    assert "done" in result["output"]
    # the service's port on the host is unreachable: the sandbox has a network namespace of its own
    port = sandbox_url.rsplit(":", 1)[1]
    probe = box.execute(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\"")
    assert "Connection refused" in probe["output"]


def test_fork_bomb_is_contained(box: Lease) -> None:
    result = box.execute("python3 -c 'import os\nwhile True:\n    os.fork()'", timeout_s=4)
    assert "Resource temporarily unavailable" in result["output"] or result["timed_out"]
    after = box.execute("ls /proc | grep -c '^[0-9]'")  # the bomb's processes are gone
    assert after["returncode"] == 0 and int(after["output"].strip()) <= 5  # init, executor, sh, ls, grep


def test_a_gigabyte_of_output_is_cut(box: Lease) -> None:
    result = box.execute("head -c 1000000000 /dev/zero | tr '\\0' x")
    assert result["truncated"] is True
    assert len(result["output"]) == 64 << 10
    assert box.execute("echo still here")["output"] == "still here\n"


def test_wall_time_kills_and_the_sandbox_is_probed_then_reused(sandbox_url: str, token: str) -> None:
    client = SandboxClient(sandbox_url, token=token)
    with client.lease("adder") as lease:
        result = lease.execute("sleep 60", timeout_s=1)
        assert result["timed_out"] is True and result["seconds"] < 10
    probes = client.stats()["probes"]
    assert probes >= 1
    with client.lease("adder") as lease:  # workspace fresh again
        assert lease.execute("ls")["output"].split() == ["adder.py", "tests"]
    client.close()


def test_memory_and_file_limits(box: Lease) -> None:
    hog = box.execute("python3 -c 'x = bytearray(4 << 30)'")
    assert "MemoryError" in hog["output"]
    big = box.execute("head -c 100000000 /dev/zero > /workspace/big; echo rc=$?; ls -la /workspace/big")
    assert "rc=0" not in big["output"]
