"""What ``miles chaos`` may kill: the processes a running ``miles train`` really has.

Nothing is guessed. The services and trainer ranks come from ``<run>/services.json``, which the
driver rewrites whenever its executor starts a process again (so a restarted engine's new pid is
there); the driver is the process ``miles chaos`` started itself; reward workers are the driver's
own ``multiprocessing`` children (:class:`miles.rewards.WorkerPool`), found in ``/proc``. A pid is
offered only while ``/proc`` shows it alive and still a child of the driver's tree, so a pid
reused by an unrelated process after a restart is never signalled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from miles_contracts.cluster import ENGINE, ROUTER, SESSION

TRAINER = "trainer"
REWARD_WORKER = "reward_worker"
SANDBOX = "sandbox"
DRIVER = "driver"
KINDS = (TRAINER, ENGINE, ROUTER, SESSION, REWARD_WORKER, SANDBOX, DRIVER)
"""Every kind of process a run may have, in the order reports list them."""
ROLLOUT_KINDS = frozenset({ENGINE, ROUTER, SESSION, REWARD_WORKER, SANDBOX})
"""Kinds whose death touches only rollout: the trainer's state and the driver's survive them."""

_PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class Target:
    """One live process of the run."""

    kind: str
    name: str  # the executor's name (engine-0, trainer-1, router), or driver / reward-worker-<pid>
    pid: int


def _parent_of(pid: int) -> int | None:
    """The parent pid ``/proc/<pid>/stat`` names (None when the process is gone or a zombie)."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # the command name (2nd field) is in parentheses and may hold spaces: split after its end
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else int(fields[1])


def _descends_from(pid: int, ancestor: int) -> bool:
    seen = 0
    current: int | None = pid
    while current is not None and current > 1 and seen < 64:
        if current == ancestor:
            return True
        current = _parent_of(current)
        seen += 1
    return False


def _children(pid: int) -> list[int]:
    found = []
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and _parent_of(int(entry.name)) == pid:
            found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> str:
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kind_of(row: dict[str, object]) -> str | None:
    name = str(row.get("name", ""))
    role = row.get("role")
    if role is None and name.startswith("trainer-"):
        return TRAINER  # trainer ranks are launched by TrainerGroup, not planned as a service role
    return str(role) if role in KINDS else None


def services_of(run_dir: Path) -> list[dict[str, object]]:
    """The rows of ``<run>/services.json`` (empty before the driver wrote it, or while a rename is
    under way)."""
    try:
        rows = json.loads((run_dir / "services.json").read_text())
    except (OSError, ValueError):
        return []
    return rows if isinstance(rows, list) else []


def discover(run_dir: Path, driver_pid: int) -> list[Target]:
    """Every live process of the run whose driver is ``driver_pid``: the driver itself first."""
    if _parent_of(driver_pid) is None:
        return []
    targets = [Target(DRIVER, DRIVER, driver_pid)]
    for row in services_of(run_dir):
        kind, pid = _kind_of(row), row.get("pid")
        if kind is not None and isinstance(pid, int) and _descends_from(pid, driver_pid):
            targets.append(Target(kind, str(row["name"]), pid))
    for child in _children(driver_pid):
        command = _cmdline(child)
        # a WorkerPool worker (spawn start method); not the resource tracker, which only cleans up
        if "multiprocessing" in command and "spawn_main" in command and "resource_tracker" not in command:
            targets.append(Target(REWARD_WORKER, f"reward-worker-{child}", child))
    return targets


def kinds_present(targets: list[Target]) -> list[str]:
    present = {t.kind for t in targets}
    return [kind for kind in KINDS if kind in present]


__all__ = ["DRIVER", "KINDS", "REWARD_WORKER", "ROLLOUT_KINDS", "SANDBOX", "TRAINER", "Target", "discover",
           "kinds_present", "services_of"]
