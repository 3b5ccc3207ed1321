"""The sandbox manager: ids, states, TTLs, persistence and the snapshot registry, over any number of tiers.

One `SandboxManager` owns one state directory:

    state_dir/
      manager.lock            flock'ed while a manager is open (a second manager on the same dir fails fast)
      sandboxes/<sid>.json    one record per sandbox (written atomically: temp file + fsync + os.replace)
      snapshots/<snap>.json   one record per snapshot (same)
      <tier>/                 each tier's own state dir (layers, images, memory files, …)

State machine (per sandbox): running ⇄ paused → killed. `exec` and every file operation need `running`
(InvalidState, 409, otherwise); `pause` needs `running`, `resume` needs `paused`; `checkpoint`, `fork`,
`set_timeout` and `kill` work in both. A killed sandbox is gone: its record is removed and later requests
for it get NotFound (404). Requests on one sandbox are serialised by a per-sandbox lock; different
sandboxes proceed concurrently (tiers must be thread-safe across sandbox ids).

TTL: a sandbox created with `timeout_s` (or given one by `set_timeout`) expires `timeout_s` seconds after
creation, after the last `set_timeout` or after the last `resume`; a background thread then pauses it
(`auto_pause=True`, the default) or kills it. Paused sandboxes never expire. A sandbox busy with a
request when it expires is paused/killed as soon as that request ends.

Snapshots: `checkpoint` asks the tier to seal the sandbox's state as a new snapshot whose parent is the
sandbox's previous snapshot (the one it was restored/forked from, or its last checkpoint), so chains are
incremental. `fork(n)` = checkpoint + n sandboxes created from that snapshot (n ≤ 16; the source keeps its
state). Deleting a snapshot other snapshots or live sandboxes still build on hides it at once (404) and
frees it in the tier when the last dependant goes away.

Persistence and recovery: every state change is on disk before the call returns. A new manager over the
same state dir reloads every record and calls `tier.recover(sid, meta, State.PAUSED)` for every sandbox:
sandboxes come back *paused* — including ones that were running when the previous manager died (their
processes may not have survived it; `resume` restarts them as the tier can). A sandbox whose recovery
fails keeps its record (with `error` set); `resume`/`checkpoint`/`fork` retry the recovery, `kill`
removes it. Records of sandboxes that were half-created when a manager died are killed and dropped.
`shutdown()` pauses every running sandbox (so nothing is lost) and stops the TTL thread; it never kills.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import logging
import math
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .. import _atomic
from .base import (MAX_FILE_BYTES, BadRequest, ExecResult, FileInfo, InvalidState, Limits, NotFound,
                   SandboxError, SnapshotInfo, State, Tier, TooLarge, Unavailable)

log = logging.getLogger("k3.env")

# tier name -> class, or "module:Class" imported on first use (so a missing/broken tier only fails when used)
DEFAULT_TIERS: dict[str, Any] = {"process": "k3.env.process:ProcessTier", "vm": "k3.env.vm:VMTier"}
DEFAULT_TIER = "process"
MAX_FORK = 16
MAX_METADATA_BYTES = 16 * 1024  # a sandbox's metadata (keys + values, UTF-8): every listing returns it
MAX_METADATA_KEYS = 64
MAX_ENV_BYTES = 1024 * 1024  # a sandbox's env (stored in its record, sent with every exec)
FORMAT_VERSION = 1
_CREATING = "creating"  # transient record state, on disk only while the tier creates the sandbox


def default_state_dir() -> Path:
    """$K3_SANDBOX_DIR, else ~/.cache/k3/sandboxes."""
    return Path(os.environ.get("K3_SANDBOX_DIR") or Path.home() / ".cache" / "k3" / "sandboxes")


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write JSON so that `path` is always either the old or the new complete file (never half-written)."""
    _atomic.atomic_write_json(path, obj, indent=1, sort_keys=True)


_fsync_dir = _atomic.fsync_dir


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    _fsync_dir(path.parent)


# ---- validation (everything is checked before anything changes) --------------------------------------
def _check_timeout_s(v: Any, what: str = "timeout_s") -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise BadRequest(f"{what} must be a positive number of seconds or null, got {v!r}")
    return float(v)


def _check_env(env: Any) -> dict[str, str] | None:
    if env is None:
        return None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise BadRequest("env must be an object of string → string")
    for k in env:
        if not k or "=" in k or "\0" in k:
            raise BadRequest(f"invalid environment variable name {k!r}")
    if any("\0" in v for v in env.values()):
        raise BadRequest("environment values must not contain NUL")
    return dict(env)


def _check_size(what: str, d: dict[str, str], max_bytes: int, max_keys: int | None) -> None:
    if max_keys is not None and len(d) > max_keys:
        raise TooLarge(f"{what} has {len(d)} entries; at most {max_keys} are allowed")
    n = sum(len(k.encode("utf-8", "surrogatepass")) + len(v.encode("utf-8", "surrogatepass")) for k, v in d.items())
    if n > max_bytes:
        raise TooLarge(f"{what} holds {n} bytes; at most {max_bytes} are allowed")


def _check_limits(limits: Any) -> Limits:
    if limits is None:
        return Limits()
    if isinstance(limits, Limits):
        d = asdict(limits)
    elif isinstance(limits, dict):
        d = {k: v for k, v in limits.items() if v is not None}
    else:
        raise BadRequest("limits must be an object")
    names = {f.name for f in fields(Limits)}
    if "disk_mb" in d:
        raise BadRequest("limits.disk_mb was renamed file_mb: it caps each file (uploads, and files commands write "
                         "on the process tier), not the sandbox's disk; nothing caps a sandbox's total disk use")
    unknown = set(d) - names
    if unknown:
        raise BadRequest(f"unknown limits {sorted(unknown)}; valid: {sorted(names)}")
    out = Limits(**d)
    for k in ("memory_mb", "pids", "file_mb"):
        v = getattr(out, k)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise BadRequest(f"limits.{k} must be a positive integer, got {v!r}")
    if isinstance(out.cpus, bool) or not isinstance(out.cpus, (int, float)) or not (0 < out.cpus < 1e6):
        raise BadRequest(f"limits.cpus must be a positive number, got {out.cpus!r}")
    out.cpus = float(out.cpus)
    if not isinstance(out.network, bool):
        raise BadRequest(f"limits.network must be a boolean, got {out.network!r}")
    return out


def _check_path(path: Any) -> str:
    if not isinstance(path, str) or not path:
        raise BadRequest("path must be a non-empty string")
    if "\0" in path:
        raise BadRequest("path must not contain NUL")
    return path


def _check_cmd(cmd: Any) -> str | list[str]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise BadRequest("cmd is empty")
        if "\0" in cmd:
            raise BadRequest("cmd must not contain NUL")
        return cmd
    if isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd):
        if any("\0" in a for a in cmd) or not cmd[0]:
            raise BadRequest("cmd arguments must be non-empty and contain no NUL")
        return list(cmd)
    raise BadRequest("cmd must be a string (run by /bin/sh -c) or a non-empty list of strings")


# ---- records -----------------------------------------------------------------------------------------
@dataclass
class _Sandbox:
    sandbox_id: str
    tier: str
    state: str  # State value or _CREATING
    limits: Limits
    created_at: float
    base: str | None = None
    snapshot_id: str | None = None  # the snapshot it was created from (restore / fork)
    parent_snapshot: str | None = None  # head of its snapshot chain: parent of its next checkpoint
    timeout_s: float | None = None
    auto_pause: bool = True
    expires_at: float | None = None  # wall clock; only meaningful while running
    env: dict[str, str] | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # the tier's metadata (from create), handed back to recover
    error: str | None = None  # why recovery failed (record kept, sandbox unusable until recovered)
    recovered: bool = field(default=True, repr=False)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("lock", "recovered")}
        d["limits"] = asdict(self.limits)
        d["version"] = FORMAT_VERSION
        return d

    @classmethod
    def from_json(cls, d: dict) -> _Sandbox:
        d = dict(d)
        d.pop("version", None)
        d["limits"] = Limits.from_record(d.get("limits", {}))
        names = {f.name for f in fields(cls)} - {"lock", "recovered"}
        return cls(**{k: v for k, v in d.items() if k in names})

    def info(self) -> dict:
        """The public view (no env values: they may hold secrets; no tier internals)."""
        return {"sandbox_id": self.sandbox_id, "state": self.state, "tier": self.tier, "base": self.base,
                "snapshot_id": self.snapshot_id, "parent_snapshot": self.parent_snapshot,
                "created_at": self.created_at, "timeout_s": self.timeout_s, "auto_pause": self.auto_pause,
                "expires_at": self.expires_at if self.state == State.RUNNING.value else None,
                "limits": asdict(self.limits), "metadata": dict(self.metadata), "error": self.error}


@dataclass
class _Snapshot:
    info: SnapshotInfo
    deleted: bool = False  # hidden (404) but kept in the tier until nothing builds on it

    def to_json(self) -> dict:
        return {"version": FORMAT_VERSION, "deleted": self.deleted, **asdict(self.info)}

    @classmethod
    def from_json(cls, d: dict) -> _Snapshot:
        d = dict(d)
        d.pop("version", None)
        deleted = bool(d.pop("deleted", False))
        names = {f.name for f in fields(SnapshotInfo)}
        return cls(SnapshotInfo(**{k: v for k, v in d.items() if k in names}), deleted)

    def public(self) -> dict:
        i = self.info
        return {"snapshot_id": i.snapshot_id, "sandbox_id": i.sandbox_id, "tier": i.tier, "parent": i.parent,
                "created_at": i.created_at}


class SandboxManager:
    """See the module docstring. All public methods are thread-safe and return JSON-able dicts (or
    `ExecResult`, bytes, `FileInfo` lists); errors are `k3.env.base.SandboxError` subclasses."""

    def __init__(self, state_dir: str | Path | None = None, tiers: dict[str, Any] | None = None,
                 default_tier: str | None = None, ttl_poll_s: float = 0.1):
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir()
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._tier_specs: dict[str, Any] = {**DEFAULT_TIERS, **(tiers or {})}
        if default_tier is None:
            default_tier = DEFAULT_TIER if DEFAULT_TIER in self._tier_specs else next(iter(self._tier_specs))
        if default_tier not in self._tier_specs:
            raise BadRequest(f"unknown default tier {default_tier!r}; valid tiers: {sorted(self._tier_specs)}")
        self.default_tier = default_tier
        self._tiers: dict[str, Tier] = {}
        self._lock = threading.RLock()  # guards the registries and the tier cache; never held across tier calls
        self._tier_lock = threading.Lock()
        self._sandboxes: dict[str, _Sandbox] = {}
        self._snapshots: dict[str, _Snapshot] = {}
        self._closed = False
        self._lockfile = open(self.state_dir / "manager.lock", "a+")
        try:
            fcntl.flock(self._lockfile.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lockfile.close()
            raise Unavailable(f"sandbox state dir {self.state_dir} is in use by another manager (a running "
                              "`k3 sandbox serve`? use its URL via K3_SANDBOX_URL, or another K3_SANDBOX_DIR)")
        self._sb_dir = self.state_dir / "sandboxes"
        self._snap_dir = self.state_dir / "snapshots"
        self._sb_dir.mkdir(exist_ok=True)
        self._snap_dir.mkdir(exist_ok=True)
        self._load()
        self._ttl_poll_s = ttl_poll_s
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="k3-sandbox-ttl", daemon=True)
        self._reaper.start()

    # ---- tiers ---------------------------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        return sorted(self._tier_specs)

    def tier_status(self) -> dict[str, dict]:
        """{tier: {"available": bool, "reason": str}} without instantiating anything."""
        out = {}
        for name in self.tier_names:
            try:
                ok, reason = self._tier_class(name).available()
            except SandboxError as e:
                ok, reason = False, str(e)
            out[name] = {"available": bool(ok), "reason": reason}
        return out

    def _tier_class(self, name: str) -> type[Tier]:
        if not isinstance(name, str) or name not in self._tier_specs:
            raise BadRequest(f"unknown tier {name!r}; valid tiers: {', '.join(self.tier_names)}")
        spec = self._tier_specs[name]
        if isinstance(spec, str):
            mod, _, attr = spec.partition(":")
            try:
                spec = getattr(importlib.import_module(mod), attr)
            except Exception as e:  # noqa: BLE001 - a broken/missing tier module must not take the manager down
                raise Unavailable(f"tier {name!r} cannot be loaded ({spec}): {type(e).__name__}: {e}") from e
            self._tier_specs[name] = spec
        return spec

    def _tier(self, name: str) -> Tier:
        t = self._tiers.get(name)
        if t is not None:
            return t
        with self._tier_lock:
            t = self._tiers.get(name)
            if t is None:
                cls = self._tier_class(name)
                ok, reason = cls.available()
                if not ok:
                    raise Unavailable(f"tier {name!r} is not available on this host: {reason}")
                d = self.state_dir / name
                d.mkdir(parents=True, exist_ok=True)
                t = cls(d)
                self._tiers[name] = t
            return t

    # ---- persistence ---------------------------------------------------------------------------------
    def _save_sandbox(self, rec: _Sandbox) -> None:
        atomic_write_json(self._sb_dir / f"{rec.sandbox_id}.json", rec.to_json())

    def _commit(self, rec: _Sandbox, **changes: Any) -> None:
        """Write `rec` with `changes` applied, then apply them in memory: what a reader sees is on disk."""
        d = rec.to_json()
        d.update({k: asdict(v) if isinstance(v, Limits) else v for k, v in changes.items()})
        atomic_write_json(self._sb_dir / f"{rec.sandbox_id}.json", d)
        for k, v in changes.items():
            setattr(rec, k, v)

    def _save_snapshot(self, snap: _Snapshot) -> None:
        atomic_write_json(self._snap_dir / f"{snap.info.snapshot_id}.json", snap.to_json())

    def _load(self) -> None:
        for d in (self._sb_dir, self._snap_dir):
            for tmp in d.glob(".*.tmp"):  # a temp file a crash left behind; the real file is intact
                _unlink(tmp)
        for p in sorted(self._snap_dir.glob("snap-*.json")):
            try:
                s = _Snapshot.from_json(json.loads(p.read_text()))
            except Exception as e:  # noqa: BLE001
                log.error("sandbox manager: unreadable snapshot record %s (%s); moved aside", p, e)
                os.replace(p, p.with_suffix(".corrupt"))
                continue
            self._snapshots[s.info.snapshot_id] = s
        for p in sorted(self._sb_dir.glob("sbx-*.json")):
            try:
                rec = _Sandbox.from_json(json.loads(p.read_text()))
            except Exception as e:  # noqa: BLE001
                log.error("sandbox manager: unreadable sandbox record %s (%s); moved aside", p, e)
                os.replace(p, p.with_suffix(".corrupt"))
                continue
            if rec.state == _CREATING or rec.state == State.KILLED.value:
                # died half-created (or half-killed): free whatever the tier made, drop the record
                with contextlib.suppress(Exception):
                    self._tier(rec.tier).kill(rec.sandbox_id)
                _unlink(p)
                continue
            rec.recovered = False
            self._sandboxes[rec.sandbox_id] = rec
            try:
                self._recover(rec)
            except Exception as e:  # noqa: BLE001
                log.warning("sandbox manager: cannot recover %s: %s", rec.sandbox_id, e)

    def _recover(self, rec: _Sandbox) -> None:
        """Bring a reloaded sandbox back, paused. Raises (and records `error`) on failure."""
        if rec.recovered:
            return
        try:
            self._tier(rec.tier).recover(rec.sandbox_id, rec.meta, State.PAUSED)
        except Exception as e:
            changes = dict(error=f"recovery failed: {e}", state=State.PAUSED.value, expires_at=None)
            try:
                self._commit(rec, **changes)
            except OSError:
                for k, v in changes.items():
                    setattr(rec, k, v)
            if isinstance(e, SandboxError):
                raise Unavailable(f"sandbox {rec.sandbox_id} could not be recovered: {e}") from e
            raise
        self._commit(rec, error=None, state=State.PAUSED.value, expires_at=None)
        rec.recovered = True

    # ---- lookup ----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the sandbox manager has been shut down")

    def _get(self, sid: Any) -> _Sandbox:
        self._check_open()
        rec = self._sandboxes.get(sid) if isinstance(sid, str) else None
        if rec is None or rec.state in (_CREATING, State.KILLED.value):
            raise NotFound(f"sandbox {sid!r} not found")
        return rec

    def _live(self, rec: _Sandbox, need: State | None = None, op: str = "") -> None:
        """Under rec.lock: the record is still there, recovered, and (if `need`) in state `need`."""
        if rec.state == State.KILLED.value or self._sandboxes.get(rec.sandbox_id) is not rec:
            raise NotFound(f"sandbox {rec.sandbox_id!r} not found")
        self._recover(rec)
        if need is not None and rec.state != need.value:
            raise InvalidState(f"cannot {op} sandbox {rec.sandbox_id}: it is {rec.state} (needs {need.value})")

    def _snap(self, snap_id: Any) -> _Snapshot:
        s = self._snapshots.get(snap_id) if isinstance(snap_id, str) else None
        if s is None or s.deleted:
            raise NotFound(f"snapshot {snap_id!r} not found")
        return s

    # ---- lifecycle -----------------------------------------------------------------------------------
    def create(self, tier: str | None = None, base: str | None = None, snapshot_id: str | None = None,
               timeout_s: float | None = None, auto_pause: bool = True, limits: Limits | dict | None = None,
               env: dict[str, str] | None = None, metadata: dict[str, str] | None = None) -> dict:
        """Start a sandbox from a base (None = the tier's default) or from a snapshot (restore)."""
        self._check_open()
        timeout_s = _check_timeout_s(timeout_s)
        if not isinstance(auto_pause, bool):
            raise BadRequest("auto_pause must be a boolean")
        lim = _check_limits(limits)
        env = _check_env(env)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in metadata.items()):
            raise BadRequest("metadata must be an object of string → string")
        _check_size("metadata", metadata, MAX_METADATA_BYTES, MAX_METADATA_KEYS)
        _check_size("env", env or {}, MAX_ENV_BYTES, None)
        if base is not None and not isinstance(base, str):
            raise BadRequest("base must be a string")
        snap = None
        if snapshot_id is not None:
            if base is not None:
                raise BadRequest("give either base or snapshot_id, not both")
            snap = self._snap(snapshot_id).info
            if tier is not None and tier != snap.tier:
                raise BadRequest(f"snapshot {snapshot_id} belongs to tier {snap.tier!r}, not {tier!r}")
            tier = snap.tier
        tier = self.default_tier if tier is None else tier
        self._tier(tier)  # unknown → 400, unavailable → 503, before anything is recorded
        rec = self._create(tier, base, snap, lim, env, timeout_s, auto_pause, dict(metadata))
        return rec.info()

    def restore(self, snapshot_id: str, **kw) -> dict:
        """A new sandbox from snapshot `snapshot_id` (same as create(snapshot_id=…))."""
        return self.create(snapshot_id=snapshot_id, **kw)

    def _create(self, tier_name: str, base: str | None, snap: SnapshotInfo | None, lim: Limits,
                env: dict | None, timeout_s: float | None, auto_pause: bool, metadata: dict) -> _Sandbox:
        tier = self._tier(tier_name)
        sid = _new_id("sbx")
        rec = _Sandbox(sandbox_id=sid, tier=tier_name, state=_CREATING, limits=lim, created_at=time.time(),
                       base=base, snapshot_id=snap.snapshot_id if snap else None,
                       parent_snapshot=snap.snapshot_id if snap else None, timeout_s=timeout_s,
                       auto_pause=auto_pause, env=env, metadata=metadata)
        with rec.lock:
            with self._lock:
                if snap is not None and self._snap(snap.snapshot_id).info is not snap:
                    raise NotFound(f"snapshot {snap.snapshot_id!r} not found")
                self._check_open()
                self._sandboxes[sid] = rec  # registered first: a concurrent snapshot delete sees the dependant
            try:
                self._save_sandbox(rec)  # "creating" on disk: a crash from here on is cleaned up at reload
                meta = tier.create(sid, lim, base=base, snapshot=snap, env=env) or {}
                self._commit(rec, meta=meta, state=State.RUNNING.value,
                             expires_at=time.time() + timeout_s if timeout_s else None)
            except BaseException:
                rec.state = State.KILLED.value
                with contextlib.suppress(Exception):
                    tier.kill(sid)
                with self._lock:
                    self._sandboxes.pop(sid, None)
                _unlink(self._sb_dir / f"{sid}.json")
                raise
        return rec

    def get(self, sandbox_id: str) -> dict:
        return self._get(sandbox_id).info()

    def list(self) -> list[dict]:
        self._check_open()
        with self._lock:
            recs = list(self._sandboxes.values())
        return [r.info() for r in sorted(recs, key=lambda r: r.created_at)
                if r.state not in (_CREATING, State.KILLED.value)]

    def kill(self, sandbox_id: str) -> None:
        rec = self._get(sandbox_id)
        with rec.lock:
            if rec.state == State.KILLED.value or self._sandboxes.get(rec.sandbox_id) is not rec:
                raise NotFound(f"sandbox {sandbox_id!r} not found")
            self._tier(rec.tier).kill(rec.sandbox_id)  # raises → nothing changed (tier.kill is idempotent)
            rec.state = State.KILLED.value
            with self._lock:
                self._sandboxes.pop(rec.sandbox_id, None)
            _unlink(self._sb_dir / f"{rec.sandbox_id}.json")
        self._gc()

    def pause(self, sandbox_id: str) -> dict:
        rec = self._get(sandbox_id)
        with rec.lock:
            self._live(rec, State.RUNNING, "pause")
            self._pause_locked(rec)
            return rec.info()

    def _pause_locked(self, rec: _Sandbox) -> None:
        self._tier(rec.tier).pause(rec.sandbox_id)
        self._commit(rec, state=State.PAUSED.value, expires_at=None)

    def resume(self, sandbox_id: str) -> dict:
        rec = self._get(sandbox_id)
        with rec.lock:
            self._live(rec, State.PAUSED, "resume")
            self._tier(rec.tier).resume(rec.sandbox_id)
            self._commit(rec, state=State.RUNNING.value,
                         expires_at=time.time() + rec.timeout_s if rec.timeout_s else None)
            return rec.info()

    def set_timeout(self, sandbox_id: str, timeout_s: float | None) -> dict:
        """TTL from now (None: never expires). On a paused sandbox it counts from the next resume."""
        timeout_s = _check_timeout_s(timeout_s)
        rec = self._get(sandbox_id)
        with rec.lock:
            self._live(rec)
            self._commit(rec, timeout_s=timeout_s, expires_at=(time.time() + timeout_s)
                         if timeout_s and rec.state == State.RUNNING.value else None)
            return rec.info()

    # ---- snapshots -----------------------------------------------------------------------------------
    def checkpoint(self, sandbox_id: str) -> dict:
        """Seal the sandbox's state as a new snapshot (parent: its previous one); it keeps its state."""
        rec = self._get(sandbox_id)
        with rec.lock:
            self._live(rec)
            return self._checkpoint_locked(rec).public()

    def _checkpoint_locked(self, rec: _Sandbox) -> _Snapshot:
        tier = self._tier(rec.tier)
        parent = self._snapshots.get(rec.parent_snapshot) if rec.parent_snapshot else None
        snap_id = _new_id("snap")
        meta = tier.checkpoint(rec.sandbox_id, snap_id, parent.info if parent else None) or {}
        snap = _Snapshot(SnapshotInfo(snapshot_id=snap_id, sandbox_id=rec.sandbox_id, tier=rec.tier,
                                      parent=parent.info.snapshot_id if parent else None, created_at=time.time(),
                                      meta=meta))
        try:
            with self._lock:
                self._snapshots[snap_id] = snap
                self._save_snapshot(snap)
        except BaseException:
            with self._lock:
                self._snapshots.pop(snap_id, None)
            with contextlib.suppress(Exception):
                tier.delete_snapshot(snap.info)
            raise
        self._commit(rec, parent_snapshot=snap_id)
        return snap

    def fork(self, sandbox_id: str, count: int = 1) -> dict:
        """Checkpoint, then `count` new running sandboxes from that snapshot (same tier, limits, env, TTL).
        All or nothing for the children: if one fails the others are killed (the snapshot stays)."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK:
            raise BadRequest(f"fork count must be an integer in 1..{MAX_FORK}, got {count!r}")
        rec = self._get(sandbox_id)
        with rec.lock:
            self._live(rec)
            snap = self._checkpoint_locked(rec)

            def child(_):
                return self._create(rec.tier, rec.base, snap.info, Limits(**asdict(rec.limits)),
                                    dict(rec.env) if rec.env else None, rec.timeout_s, rec.auto_pause,
                                    {**rec.metadata, "forked_from": rec.sandbox_id})

            with ThreadPoolExecutor(max_workers=min(count, 8), thread_name_prefix="k3-fork") as ex:
                futs = [ex.submit(child, i) for i in range(count)]
            children, errors = [], []
            for f in futs:
                try:
                    children.append(f.result())
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)
            if errors:
                for c in children:
                    with contextlib.suppress(Exception):
                        self.kill(c.sandbox_id)
                raise errors[0]
            return {"snapshot_id": snap.info.snapshot_id, "sandboxes": [c.info() for c in children]}

    def list_snapshots(self) -> list[dict]:
        self._check_open()
        with self._lock:
            snaps = [s for s in self._snapshots.values() if not s.deleted]
        return [s.public() for s in sorted(snaps, key=lambda s: s.info.created_at)]

    def get_snapshot(self, snapshot_id: str) -> dict:
        self._check_open()
        return self._snap(snapshot_id).public()

    def snapshot_info(self, snapshot_id: str) -> SnapshotInfo:
        """The full record, tier metadata included."""
        self._check_open()
        return self._snap(snapshot_id).info

    def _dependants(self, snap_id: str) -> bool:
        return (any(s.info.parent == snap_id for s in self._snapshots.values())
                or any(r.parent_snapshot == snap_id for r in self._sandboxes.values()))

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._check_open()
        with self._lock:
            snap = self._snap(snapshot_id)
            if self._dependants(snapshot_id):
                snap.deleted = True  # hidden now; freed by _gc when nothing builds on it any more
                try:
                    self._save_snapshot(snap)
                except BaseException:
                    snap.deleted = False
                    raise
                return
            self._tier(snap.info.tier).delete_snapshot(snap.info)  # raises → nothing changed
            self._snapshots.pop(snapshot_id, None)
            _unlink(self._snap_dir / f"{snapshot_id}.json")
        self._gc()

    def _gc(self) -> None:
        """Free hidden snapshots nothing builds on any more (cascades up parent chains)."""
        while True:
            with self._lock:
                victims = [s for sid, s in self._snapshots.items() if s.deleted and not self._dependants(sid)]
                if not victims:
                    return
                progressed = False
                for s in victims:
                    try:
                        self._tier(s.info.tier).delete_snapshot(s.info)
                    except Exception as e:  # noqa: BLE001 - retried at the next gc
                        log.warning("sandbox manager: cannot free snapshot %s yet: %s", s.info.snapshot_id, e)
                        continue
                    self._snapshots.pop(s.info.snapshot_id, None)
                    _unlink(self._snap_dir / f"{s.info.snapshot_id}.json")
                    progressed = True
                if not progressed:
                    return

    # ---- work ----------------------------------------------------------------------------------------
    def exec(self, sandbox_id: str, cmd: str | list[str], timeout: float = 60.0, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | None = None) -> ExecResult:
        cmd = _check_cmd(cmd)
        timeout = _check_timeout_s(timeout, "timeout")
        if timeout is None:
            raise BadRequest("timeout must be a positive number of seconds")
        env = _check_env(env)
        if cwd is not None:
            cwd = _check_path(cwd)
        if stdin is not None and not isinstance(stdin, (bytes, bytearray)):
            raise BadRequest("stdin must be bytes")
        rec = self._get(sandbox_id)
        with rec.lock:
            self._live(rec, State.RUNNING, "exec in")
            return self._tier(rec.tier).exec(rec.sandbox_id, cmd, timeout=timeout, env=env, cwd=cwd,
                                             stdin=bytes(stdin) if stdin is not None else None)

    def upload_limit(self, sandbox_id: str | None = None) -> int:
        """Largest accepted upload: MAX_FILE_BYTES, or the sandbox's limits.file_mb if smaller."""
        if sandbox_id is None:
            return MAX_FILE_BYTES
        rec = self._get(sandbox_id)
        return min(MAX_FILE_BYTES, rec.limits.file_mb * 1024 * 1024)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        path = _check_path(path)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadRequest("data must be bytes")
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise BadRequest(f"mode must be an integer in 0..0o7777, got {mode!r}")
        cap = self.upload_limit(sandbox_id)
        if len(data) > cap:
            raise TooLarge(f"file of {len(data)} bytes exceeds the upload limit of {cap} bytes")
        rec = self._get(sandbox_id)
        with rec.lock:
            self._live(rec, State.RUNNING, "write files in")
            self._tier(rec.tier).write_file(rec.sandbox_id, path, bytes(data), mode=mode)

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        path = _check_path(path)
        rec = self._get(sandbox_id)
        with rec.lock:
            self._live(rec, State.RUNNING, "read files in")
            return self._tier(rec.tier).read_file(rec.sandbox_id, path)

    def list_files(self, sandbox_id: str, path: str = "/") -> list[FileInfo]:
        path = _check_path(path)
        rec = self._get(sandbox_id)
        with rec.lock:
            self._live(rec, State.RUNNING, "list files in")
            return self._tier(rec.tier).list_files(rec.sandbox_id, path)

    # ---- TTL -----------------------------------------------------------------------------------------
    def _reap_loop(self) -> None:
        while not self._stop.wait(self._ttl_poll_s):
            try:
                self._reap_once()
            except Exception:  # noqa: BLE001 - the reaper must survive anything
                log.exception("sandbox manager: TTL reaper error")

    def _reap_once(self) -> None:
        now = time.time()
        with self._lock:
            due = [r for r in self._sandboxes.values() if r.state == State.RUNNING.value
                   and r.expires_at is not None and r.expires_at <= now]
        for rec in due:
            if not rec.lock.acquire(blocking=False):
                continue  # busy with a request: expire it at a later tick, once that request ends
            try:
                if (rec.state != State.RUNNING.value or rec.expires_at is None or rec.expires_at > time.time()
                        or self._sandboxes.get(rec.sandbox_id) is not rec):
                    continue
                try:
                    if rec.auto_pause:
                        self._pause_locked(rec)
                        log.info("sandbox manager: %s expired, paused", rec.sandbox_id)
                    else:
                        self.kill(rec.sandbox_id)
                        log.info("sandbox manager: %s expired, killed", rec.sandbox_id)
                except Exception as e:  # noqa: BLE001
                    log.warning("sandbox manager: cannot expire %s (%s); retrying in 5 s", rec.sandbox_id, e)
                    rec.expires_at = time.time() + 5.0
            finally:
                rec.lock.release()

    # ---- shutdown ------------------------------------------------------------------------------------
    def shutdown(self, wait_s: float = 10.0) -> None:
        """Stop the TTL thread and pause every running sandbox (kills nothing: paused sandboxes and all
        snapshots survive for the next manager). A sandbox still busy after `wait_s` is left running on
        disk; the next manager recovers it paused anyway. Idempotent."""
        if self._closed:
            return
        self._stop.set()
        if self._reaper.is_alive() and self._reaper is not threading.current_thread():
            self._reaper.join(timeout=5)
        with self._lock:
            recs = list(self._sandboxes.values())
        deadline = time.monotonic() + wait_s
        for rec in recs:
            if not rec.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                log.warning("sandbox manager: %s busy at shutdown, left as is", rec.sandbox_id)
                continue
            try:
                if rec.state == State.RUNNING.value and rec.recovered:
                    try:
                        self._pause_locked(rec)
                    except Exception as e:  # noqa: BLE001
                        log.warning("sandbox manager: cannot pause %s at shutdown: %s", rec.sandbox_id, e)
            finally:
                rec.lock.release()
        self._closed = True
        with contextlib.suppress(Exception):
            fcntl.flock(self._lockfile.fileno(), fcntl.LOCK_UN)
        self._lockfile.close()

    close = shutdown

    def __enter__(self) -> SandboxManager:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# ---- the process-wide default manager (in-process `Sandbox` mode) -----------------------------------------
_default: SandboxManager | None = None
_default_lock = threading.Lock()


def default_manager() -> SandboxManager:
    """The process-wide manager over $K3_SANDBOX_DIR (or ~/.cache/k3/sandboxes), created on first use and
    shut down (running sandboxes paused) at interpreter exit."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            import atexit
            _default = SandboxManager(default_state_dir())
            atexit.register(_default.shutdown)
        return _default


def set_default_manager(manager: SandboxManager | None) -> None:
    """Replace the process-wide default manager (e.g. in tests)."""
    global _default
    with _default_lock:
        _default = manager
