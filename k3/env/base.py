"""Agent sandboxes: the one interface both tiers implement, and the types they share.

A *tier* (backend) owns the mechanics of isolation for many sandboxes, each named by an id the manager
chooses; the manager (`manager.py`) owns ids, states, TTLs, persistence and the snapshot registry, and is
what the REST server and the `Sandbox` client talk to.

Tiers:
- "process": Linux namespaces + overlayfs + cgroup-v1 limits and freezer. Checkpoints are filesystem-level:
  a restored or forked sandbox restarts its processes from its files.
- "vm": a QEMU microvm (TCG unless a working KVM exists). Checkpoints hold the full memory state:
  processes continue after restore and in every fork.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import asdict, dataclass, field
from pathlib import Path


class SandboxError(Exception):
    """Base error; `status` is the HTTP status the REST server answers with."""

    status = 400


class BadRequest(SandboxError):
    status = 400


class NotFound(SandboxError):
    status = 404


class InvalidState(SandboxError):
    """Operation not allowed in the sandbox's current state (e.g. exec on a paused sandbox)."""

    status = 409


class TooLarge(SandboxError):
    status = 413


class Unavailable(SandboxError):
    """The tier cannot run on this host (e.g. QEMU not installed); the message says how to install it."""

    status = 503


class State(str, enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    KILLED = "killed"


@dataclass
class Limits:
    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 256
    file_mb: int = 1024  # largest file: caps each upload, and (process tier) each file a command writes
    network: bool = False  # False: loopback only
    # There is no cap on a sandbox's total disk use: this field was `disk_mb`, which promised one (issue 17).

    @classmethod
    def from_record(cls, d: dict) -> "Limits":
        """Limits from a stored record; records written before the rename carry `disk_mb` (= file_mb)."""
        d = dict(d)
        if "disk_mb" in d:
            d.setdefault("file_mb", d.pop("disk_mb"))
        return cls(**d)


@dataclass
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    duration_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FileInfo:
    name: str
    path: str
    is_dir: bool
    size: int


@dataclass
class SnapshotInfo:
    snapshot_id: str
    sandbox_id: str  # the sandbox it was taken from
    tier: str
    parent: str | None  # the snapshot this one is layered on (None for the first)
    created_at: float
    meta: dict = field(default_factory=dict)  # tier-specific (layer paths, memory file, …)


def command_argv(cmd: str | list[str]) -> list[str]:
    """A command as argv: a string runs through `/bin/sh -c`; a list is used as is. BadRequest otherwise."""
    if isinstance(cmd, str):
        argv = ["/bin/sh", "-c", cmd]
    elif isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd):
        argv = list(cmd)
    else:
        raise BadRequest("cmd must be a string or a non-empty list of strings")
    if any("\0" in a for a in argv):
        raise BadRequest("cmd contains a NUL byte")
    return argv


MAX_FILE_BYTES = 64 * 1024 * 1024  # file API upload cap (413 beyond)
MAX_OUTPUT_BYTES = 16 * 1024 * 1024  # exec stdout/stderr cap each (truncated beyond, flagged in stderr)


class Tier(abc.ABC):
    """One isolation mechanism. All paths in the file API are absolute paths *inside* the sandbox; a tier
    must refuse (BadRequest) any path that would resolve outside the sandbox root (`..`, symlinks)."""

    name: str

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)  # the tier keeps its sandboxes and snapshots under here

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """(usable on this host, reason if not)."""
        return True, ""

    # lifecycle ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def create(self, sid: str, limits: Limits, base: str | None = None, snapshot: SnapshotInfo | None = None,
               env: dict[str, str] | None = None) -> dict:
        """Start sandbox `sid` from a base image (None = default base) or from a snapshot. Returns tier
        metadata (JSON-able) the manager persists and hands back to `recover`."""

    @abc.abstractmethod
    def kill(self, sid: str) -> None:
        """Stop every process and remove every mount, cgroup and file of `sid`. Idempotent."""

    @abc.abstractmethod
    def pause(self, sid: str) -> None:
        """Freeze: no CPU used until resume."""

    @abc.abstractmethod
    def resume(self, sid: str) -> None: ...

    @abc.abstractmethod
    def checkpoint(self, sid: str, snapshot_id: str, parent: SnapshotInfo | None) -> dict:
        """Seal the current state as snapshot `snapshot_id` (incremental over `parent` where possible).
        The sandbox keeps running (or stays paused) afterwards. Returns the snapshot's tier metadata."""

    @abc.abstractmethod
    def delete_snapshot(self, snap: SnapshotInfo) -> None: ...

    def recover(self, sid: str, meta: dict, state: State) -> None:
        """After a manager restart: re-attach to a sandbox that was paused (the tier may restart it
        from its files); raise SandboxError if it cannot be recovered."""
        raise SandboxError(f"tier {self.name} cannot recover sandbox {sid}")

    # work --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def exec(self, sid: str, cmd: str | list[str], timeout: float = 60.0, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | None = None) -> ExecResult:
        """Run a command (a string goes to /bin/sh -c) and wait. A missing binary gives exit code 127."""

    @abc.abstractmethod
    def read_file(self, sid: str, path: str) -> bytes: ...

    @abc.abstractmethod
    def write_file(self, sid: str, path: str, data: bytes, mode: int = 0o644) -> None: ...

    @abc.abstractmethod
    def list_files(self, sid: str, path: str) -> list[FileInfo]: ...
