"""The ``sandbox`` config section: where task templates live, how many sandboxes, their limits."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SandboxLimits(BaseModel):
    """What one command (and one sandbox) may use. Per process unless said otherwise.

    :ivar wall_s: seconds a command may run (a request may ask for less, never more).
    :ivar cpu_s: CPU seconds per process (``RLIMIT_CPU``).
    :ivar memory_mb: address space per process (``RLIMIT_AS``).
    :ivar processes: processes of the whole sandbox (``RLIMIT_NPROC`` counted in its own user
        namespace; enforced when the service runs as root and gives each sandbox its own uid).
    :ivar file_mb: largest file a command may write (``RLIMIT_FSIZE``).
    :ivar open_files: open files per process (``RLIMIT_NOFILE``).
    :ivar output_bytes: bytes of a command's output returned; past them it is killed and the
        result says ``truncated``.
    :ivar workspace_mb: size of the workspace (a tmpfs; ``/tmp`` gets the same).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_s: float = Field(default=30.0, gt=0, le=3600)
    cpu_s: int = Field(default=60, ge=1)
    memory_mb: int = Field(default=1024, ge=64)
    processes: int = Field(default=64, ge=4)
    file_mb: int = Field(default=64, ge=1)
    open_files: int = Field(default=256, ge=16)
    output_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20)
    workspace_mb: int = Field(default=256, ge=1)

    def rlimits(self) -> dict[str, int]:
        """The per-process limits, by ``resource`` name, as the in-sandbox executor applies them."""
        return {"RLIMIT_CPU": self.cpu_s, "RLIMIT_AS": self.memory_mb << 20, "RLIMIT_FSIZE": self.file_mb << 20,
                "RLIMIT_NOFILE": self.open_files, "RLIMIT_CORE": 0}


class SandboxSection(BaseModel):
    """``sandbox``: the sandbox service of a run (``miles_sandbox``; see docs/design/sandbox.md).

    :ivar templates_dir: folder of task templates; a lease names one of its sub-folders, copied into
        the sandbox's fresh workspace (relative: to the folder the run was started in). None:
        leases start from an empty workspace.
    :ivar pool_size: sandboxes at most (each episode holds one); all are started warm.
    :ivar acquire_timeout_s: how long a lease request waits for a free sandbox before 503.
    :ivar lease_idle_s: a lease nobody used for this long is taken back (an agent that died).
    :ivar base_uid: as root, sandbox ``i`` runs as uid ``base_uid + i`` (so its process limit is its own).
    :ivar python: interpreter inside the sandbox (the executor and the tasks' tests run with it); it
        must live under ``/usr`` (only ``/usr`` and ``/etc`` of the host are visible inside).
    :ivar max_template_mb: largest template (packed) a lease may copy in.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    templates_dir: str | None = None
    pool_size: int = Field(default=8, ge=1, le=1024)
    acquire_timeout_s: float = Field(default=120.0, gt=0)
    lease_idle_s: float = Field(default=900.0, gt=0)
    base_uid: int = Field(default=1_100_000, ge=1000, lt=2**31 - 4096)
    python: str = "/usr/bin/python3"
    max_template_mb: float = Field(default=16.0, gt=0)
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
