"""The process tier's sandboxes, warm inits and the tier itself (see the package docstring for the design)."""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import marshal
import os
import re
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tarfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..._atomic import atomic_write_json
from .. import _fs
from ..base import (MAX_FILE_BYTES, MAX_OUTPUT_BYTES, BadRequest, ExecResult, FileInfo, InvalidState, Limits,
                    NotFound, SandboxError, SnapshotInfo, State, Tier, TooLarge, Unavailable, command_argv)
from .bases import _BASE_TOP, _build_default_base, _py_prefix, allowed_base_path, base_roots_from_env
from .cgroups import _cg_freeze, _cg_kill_all, _cg_remove, _write, cg_setup, cgroup_dirs, cgroup_mode, freezer_dir

PIDS_OVERHEAD = 2  # the unshare and the init
OVERLAY_OPTIONS = {"index": "off", "redirect_dir": "on", "metacopy": "off"}
TIMEOUT_EXIT = 124
MAX_EXEC_REQUEST = 4 * 1024 * 1024  # argv + env of one exec (execve's own limit is about 2 MiB)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
_FS_DIR = str(Path(_fs.__file__).resolve().parent)  # the init imports _fs from here (before pivot_root)
INIT_PROGRAM = str(Path(__file__).resolve().parent / "init.py")  # run by the host's interpreter as the init


def _check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise BadRequest(f"invalid {kind} {value!r}: use 1-128 of [A-Za-z0-9_.-], not starting with '.' '_' '-'")
    return value


def _atomic_json(path: Path, obj) -> None:
    atomic_write_json(path, obj, indent=1)


def _proc_start(pid: int) -> int:
    """Start time of a process (clock ticks since boot), 0 if it does not exist: guards against pid reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if path.exists() or path.is_symlink():
        shutil.rmtree(path)  # raise the real error


# --- runtime state of one sandbox -------------------------------------------------------------------------------
@dataclass
class _Sandbox:
    sid: str
    dir: Path
    base: str  # base directory (lowest lower)
    binds: list  # [[host dir, path inside]] read-only binds (the default base)
    layers: list  # sealed layer dirs, newest first
    limits: Limits
    env: dict
    cgroups: list  # cgroup dirs
    state: State = State.RUNNING
    proc: subprocess.Popen | None = None  # the unshare process (our child)
    init_pid: int = 0  # host pid of the init (pid 1 inside)
    init_start: int = 0
    ctl: socket.socket | None = None  # SEQPACKET to the init: exec requests; closing it ends the init
    ctl_lock: threading.Lock = field(default_factory=threading.Lock)
    lock: threading.RLock = field(default_factory=threading.RLock)

    upper = property(lambda self: self.dir / "upper")
    work = property(lambda self: self.dir / "work")
    root = property(lambda self: self.dir / "root")

    def record(self) -> dict:
        return {"sid": self.sid, "base": self.base, "binds": self.binds, "layers": self.layers,
                "limits": asdict(self.limits), "env": self.env, "cgroups": [str(c) for c in self.cgroups],
                "state": self.state.value, "init_pid": self.init_pid, "init_start": self.init_start,
                "unshare_pid": self.proc.pid if self.proc else 0}

    def save(self) -> None:
        _atomic_json(self.dir / "run.json", self.record())

    def new_upper(self) -> None:
        """An empty upper dir; its root gives the sandbox's / its mode and owner: keep the top layer's."""
        self.upper.mkdir()
        st = os.stat(self.layers[0] if self.layers else self.base)
        os.chown(self.upper, st.st_uid, st.st_gid)
        os.chmod(self.upper, stat.S_IMODE(st.st_mode))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Kill every process of the sandbox (the mounts go with the init's namespaces); keep files/cgroups."""
        with self.ctl_lock:
            if self.ctl is not None:
                self.ctl.close()
                self.ctl = None
        _cg_kill_all(self.cgroups)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
            self.proc = None
        elif self.init_pid and _proc_start(self.init_pid) == self.init_start:  # a stale init (not our child)
            os.kill(self.init_pid, signal.SIGKILL)
        self.init_pid = self.init_start = 0

    def destroy(self) -> None:
        """Stop, remove the cgroups and every file of the sandbox."""
        self.stop()
        _cg_remove(self.cgroups)
        _rmtree(self.dir)
        self.state = State.KILLED


class _Warm:
    """A spawned, not yet configured init: `unshare --fork` (pid, mount, uts, ipc and, if netns, net namespaces;
    the cgroup namespace comes later, see init.py) running `python -I -S init.py` with every module imported,
    waiting for its config on `ctl`. Its env is only PATH and LANG, its argv has no config, its cwd is /."""

    def __init__(self, proc: subprocess.Popen | None, st_r: int, ctl: socket.socket):
        self.proc, self.st_r, self.ctl, self.init_pid, self.init_start = proc, st_r, ctl, 0, 0

    def alive(self) -> bool:
        """Both processes still there (the init's pid not reused: it could be freed once the unshare reaps it)."""
        return self.proc.poll() is None and _proc_start(self.init_pid) == self.init_start

    @classmethod
    def spawn(cls, unshare: str, netns: bool, timeout: float) -> _Warm:
        st_r, st_w = os.pipe()
        ctl, ctl_init = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [unshare, "--fork", "--pid", "--mount", "--uts", "--ipc", *(["--net"] if netns else []),
               "--kill-child", "--propagation", "private", "--", os.path.realpath(sys.executable), "-I", "-S",
               INIT_PROGRAM, _FS_DIR, str(st_w), str(ctl_init.fileno())]
        w = cls(None, st_r, ctl)
        try:
            w.proc = subprocess.Popen(  # spared by the OOM killer (-1000, inherited by the init)
                ["/bin/sh", "-c", 'echo -1000 > /proc/self/oom_score_adj; exec "$@"', "k3-init", *cmd],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/",
                pass_fds=(st_w, ctl_init.fileno()), start_new_session=True,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})
        except BaseException:
            w.kill()
            raise
        finally:
            os.close(st_w)
            ctl_init.close()
        line = _read_line(st_r, timeout)
        if not line.startswith("p "):
            proc = w.proc
            w.kill()
            err = proc.stderr.read(2000).decode(errors="replace")  # (the init's stderr is init.log once configured)
            raise SandboxError(f"sandbox init failed to start: {line or 'no answer'} {err}".strip())
        w.init_pid = int(line[2:])
        w.init_start = _proc_start(w.init_pid)
        return w

    def kill(self) -> None:
        """Close our ends and kill the processes (--kill-child: the init dies with the unshare), if still ours."""
        if self.st_r >= 0:
            os.close(self.st_r)
            self.st_r = -1
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class _Pool:
    """A few warm inits per network flavour, so a start skips process and Python start-up. A background thread
    refills the flavours asked for while no start is in flight (it would compete with them for the CPU). Closed
    by the _Table (close, GC, interpreter exit); a pool init whose tier process died sees EOF on ctl and exits."""

    SIZE = 4

    def __init__(self, unshare: str):
        self.unshare = unshare
        self.cond = threading.Condition()
        self.idle: dict[bool, list[_Warm]] = {}  # netns -> warm inits
        self.closed = False
        self.busy = 0  # starts in flight: between take() and done()
        self.thread: threading.Thread | None = None

    def take(self, netns: bool) -> _Warm | None:
        """A warm init (None if there is none); the caller must call done() once its start is over."""
        with self.cond:
            self.busy += 1
            if self.closed:
                return None
            idle = self.idle.setdefault(netns, [])
            while idle:
                w = idle.pop()
                if w.alive():
                    return w
                w.kill()
        return None

    def done(self) -> None:
        """A start is over: wake (or start) the filler."""
        with self.cond:
            self.busy -= 1
            if self.thread is None and not self.closed:
                self.thread = threading.Thread(target=self._fill, name="k3-init-pool", daemon=True)
                self.thread.start()
            self.cond.notify()

    def _fill(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (self.busy or all(len(v) >= self.SIZE for v in self.idle.values())):
                    self.cond.wait()
                if self.closed:
                    return
                netns = next(k for k, v in self.idle.items() if len(v) < self.SIZE)
            try:
                w = _Warm.spawn(self.unshare, netns, 20.0)
            except Exception:  # noqa: BLE001 - starts will spawn (and report) on their own
                time.sleep(1.0)
                continue
            with self.cond:
                if not self.closed:
                    self.idle[netns].append(w)
                    continue
            w.kill()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            idle = [w for v in self.idle.values() for w in v]
            self.idle.clear()
            self.cond.notify_all()
        for w in idle:
            w.kill()


class _Table:
    """The live sandboxes (and the pool of warm inits) of one ProcessTier, kept apart from it so a finalizer
    can clean up without it."""

    def __init__(self, unshare: str):
        self.lock = threading.Lock()
        self.sandboxes: dict[str, _Sandbox] = {}
        self.pool = _Pool(unshare)

    def close(self, keep_files: bool = False) -> None:
        self.pool.close()
        with self.lock:
            boxes = list(self.sandboxes.values())
            self.sandboxes.clear()
        for sb in boxes:
            with sb.lock:
                try:
                    if keep_files:
                        sb.stop()
                        _cg_remove(sb.cgroups)
                    else:
                        sb.destroy()
                except Exception as e:  # noqa: BLE001 - best effort at shutdown
                    print(f"k3.env.process: cleanup of {sb.sid} failed: {e}", file=sys.stderr)


_TABLES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _at_exit() -> None:
    for table in list(_TABLES):
        table.close(keep_files=True)



# --- the tier ----------------------------------------------------------------------------------------------------
class ProcessTier(Tier):
    """Sandboxes as namespaced process trees over an overlayfs root; see the module docstring."""

    name = "process"

    def __init__(self, state_dir: Path, base_roots: list[str] | None = None):
        """`base_roots`: directories under which absolute-path bases are allowed (default: $K3_SANDBOX_BASE_ROOTS;
        see bases.py); nothing else of the host can be a base."""
        super().__init__(state_dir)
        self.base_roots = list(base_roots) if base_roots is not None else base_roots_from_env()
        ok, why = self.available()
        if not ok:
            raise Unavailable(why)
        self.state_dir = Path(os.path.realpath(self.state_dir))
        for sub in ("bases", "layers", "sandboxes"):  # 0700: uppers hold root-owned files the sandbox made
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(self.state_dir / sub, 0o700)
        self._tag = hashlib.sha1(str(self.state_dir).encode()).hexdigest()[:8]
        self._unshare = shutil.which("unshare")
        self._table = _Table(self._unshare)
        self._gc_lock = threading.Lock()
        self._base_lock = threading.Lock()
        _TABLES.add(self._table)
        self._finalizer = weakref.finalize(self, self._table.close)
        self._finalizer.atexit = False  # at exit: _at_exit (keeps files for recover)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        if sys.platform != "linux" or os.geteuid() != 0:
            return False, "the process tier needs Linux and root"
        mode, why = cgroup_mode()
        if mode is None:
            return False, why
        if "overlay" not in Path("/proc/filesystems").read_text():
            return False, "overlayfs is not available (modprobe overlay)"
        if not shutil.which("unshare"):
            return False, "unshare not found: apt-get install util-linux"
        return True, ""

    def close(self) -> None:
        """Kill every sandbox of this tier and delete its files (also done when the tier is collected)."""
        self._table.close()

    # lifecycle -----------------------------------------------------------------------------------------------
    def create(self, sid: str, limits: Limits, base: str | None = None, snapshot: SnapshotInfo | None = None,
               env: dict[str, str] | None = None) -> dict:
        """Start `sid` on a fresh upper over the snapshot's layers (shared, never copied) or over a base."""
        _check_id("sandbox id", sid)
        limits = limits or Limits()
        if snapshot is not None:
            meta = snapshot.meta or {}
            layers, base_dir, binds = list(meta.get("layers", [])), meta.get("base"), meta.get("binds", [])
            for p in layers + [base_dir]:
                if not p or not Path(p).is_dir():
                    raise NotFound(f"snapshot {snapshot.snapshot_id}: layer {p} is gone")
        else:
            layers = []
            base_dir, binds = self._resolve_base(base)
        env = _check_env(env or {})
        sdir = self.state_dir / "sandboxes" / sid
        with self._table.lock:
            if sid in self._table.sandboxes:
                raise InvalidState(f"sandbox {sid} exists")
            cgroups = self._cgroups_of(sid)
            sb = _Sandbox(sid, sdir, base_dir, binds, layers, limits, env, cgroups)
            self._table.sandboxes[sid] = sb
        with sb.lock:
            try:
                if sdir.exists():  # leftovers of a sandbox nobody recovered
                    _cg_kill_all(cgroups)
                    _rmtree(sdir)
                for sub in ("work", "root"):
                    (sdir / sub).mkdir(parents=True)
                sb.new_upper()
                self._start(sb)
                sb.save()
            except BaseException:
                with self._table.lock:
                    self._table.sandboxes.pop(sid, None)
                try:
                    sb.destroy()
                except Exception:  # noqa: BLE001 - report the original error
                    pass
                raise
        return {"layers": layers, "base": base_dir, "binds": binds, "dir": str(sdir), "init_pid": sb.init_pid}

    def kill(self, sid: str) -> None:
        _check_id("sandbox id", sid)
        with self._table.lock:
            sb = self._table.sandboxes.pop(sid, None)
        if sb is None:  # unknown here: clean up whatever a previous process left
            sb = self._load(sid, {}) or _Sandbox(sid, self.state_dir / "sandboxes" / sid, "", [], [], Limits(), {},
                                                 self._cgroups_of(sid))
        with sb.lock:
            sb.destroy()
        self._gc_layers()

    def pause(self, sid: str) -> None:
        self._set_frozen(sid, True)

    def resume(self, sid: str) -> None:
        self._set_frozen(sid, False)

    def _set_frozen(self, sid: str, frozen: bool) -> None:
        """Freeze (pause) or thaw (resume) the sandbox's cgroup; a no-op when it is already in that state."""
        sb = self._get(sid)
        want = State.PAUSED if frozen else State.RUNNING
        with sb.lock:
            if sb.state is want:
                return
            _cg_freeze(self._freezer(sb), frozen)
            sb.state = want
            sb.save()

    def checkpoint(self, sid: str, snapshot_id: str, parent: SnapshotInfo | None) -> dict:
        """Seal the upper as layers/<snapshot_id> and restart the sandbox over it with a fresh upper.
        Processes of the sandbox are killed (the filesystem carries on); a paused sandbox stays paused."""
        _check_id("snapshot id", snapshot_id)
        sb = self._get(sid)
        layer = self.state_dir / "layers" / snapshot_id
        with sb.lock:
            if layer.exists():
                raise InvalidState(f"snapshot {snapshot_id} exists")
            paused = sb.state is State.PAUSED
            sb.stop()
            try:
                os.rename(sb.upper, layer)
                sb.layers = [str(layer)] + sb.layers
                _atomic_json(layer.with_name(f".{snapshot_id}.json"), {"layers": sb.layers, "base": sb.base})
            finally:
                if not sb.upper.exists():
                    sb.new_upper()  # on failure too: carry on over whatever stack and upper there are
                self._restart(sb, State.PAUSED if paused else State.RUNNING, setup_cgroups=False)
            return {"layers": list(sb.layers), "base": sb.base, "binds": sb.binds}

    def delete_snapshot(self, snap: SnapshotInfo) -> None:
        """Tombstone the snapshot; its layer is deleted once no other snapshot or sandbox stacks it."""
        _check_id("snapshot id", snap.snapshot_id)
        layer = self.state_dir / "layers" / snap.snapshot_id
        if layer.exists():
            layer.with_name(f".{snap.snapshot_id}.deleted").touch()
        self._gc_layers()

    def recover(self, sid: str, meta: dict, state: State) -> None:
        """Restart `sid`'s init over its layers and existing upper (frozen again if `state` is paused); kills
        whatever a previous process left running in its cgroups. Processes are not recovered."""
        _check_id("sandbox id", sid)
        state = State(state)
        if state is State.KILLED:
            return self.kill(sid)
        with self._table.lock:
            if sid in self._table.sandboxes:
                sb = self._table.sandboxes[sid]
            else:
                sb = self._load(sid, meta)
                if sb is None:
                    raise SandboxError(f"sandbox {sid}: nothing to recover under {self.state_dir}")
                self._table.sandboxes[sid] = sb
        with sb.lock:
            try:
                if not sb.alive():
                    stale_unshare = _json(sb.dir / "run.json").get("unshare_pid", 0)
                    sb.stop()
                    _reap(stale_unshare)
                    if not sb.upper.exists():
                        sb.new_upper()
                    sb.root.mkdir(exist_ok=True)
                    self._restart(sb, state)
                elif sb.state is not state:
                    _cg_freeze(self._freezer(sb), state is State.PAUSED)
                    sb.state = state
                    sb.save()
            except BaseException as e:
                with self._table.lock:
                    self._table.sandboxes.pop(sid, None)
                try:
                    sb.stop()
                    _cg_remove(sb.cgroups)
                except Exception:  # noqa: BLE001
                    pass
                raise e if isinstance(e, SandboxError) else SandboxError(f"recover {sid}: {e}") from e

    # work ----------------------------------------------------------------------------------------------------
    def exec(self, sid: str, cmd: str | list[str], timeout: float = 60.0, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | None = None) -> ExecResult:
        sb = self._get(sid)
        if sb.state is State.PAUSED:
            raise InvalidState(f"sandbox {sid} is paused")
        argv = command_argv(cmd)
        full_env = {**self._default_env(sb), **sb.env, **_check_env(env or {})}
        try:
            wd = _fs.norm(cwd or "/")
        except ValueError as e:
            raise BadRequest(str(e)) from e
        with self._root(sb) as root:  # the init chdirs inside its own root; this only gives a clear error
            try:
                os.close(_fs.open_in_root(root, wd, os.O_PATH | os.O_DIRECTORY))
            except OSError as e:
                raise BadRequest(f"cwd {cwd!r}: {e.strerror}") from e
        request = marshal.dumps({"argv": argv, "env": full_env, "cwd": wd,
                                 "fsize": sb.limits.file_mb * 1024 * 1024})  # RLIMIT_FSIZE of the command
        if len(request) > MAX_EXEC_REQUEST:
            raise TooLarge(f"command and environment exceed {MAX_EXEC_REQUEST} bytes")
        t0 = time.monotonic()
        mine, theirs = socket.socketpair()
        pipes = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr
        try:
            with sb.ctl_lock:
                if sb.ctl is None:
                    raise SandboxError(f"sandbox {sid} is not running")
                socket.send_fds(sb.ctl, [b"x"], [pipes[0][0], pipes[1][1], pipes[2][1], theirs.fileno()])
        except BaseException:
            mine.close()
            for fd in (pipes[0][1], pipes[1][0], pipes[2][0]):
                os.close(fd)
            raise
        finally:  # the init has its own copies now
            theirs.close()
            for fd in (pipes[0][0], pipes[1][1], pipes[2][1]):
                os.close(fd)
        try:
            mine.settimeout(30)
            mine.sendall(struct.pack("Q", len(request)) + request)
        except OSError:
            pass  # the init is gone: _communicate sees EOF
        out, err, wstatus, timed_out = _communicate(mine, pipes[0][1], pipes[1][0], pipes[2][0], stdin or b"",
                                                    t0 + max(0.0, float(timeout)))
        if timed_out:
            code = TIMEOUT_EXIT
        elif wstatus is None:  # the init died under the command (kill, checkpoint)
            code, err = 128 + signal.SIGKILL, err + "\n[k3: the sandbox stopped during exec]"
        else:
            code = os.waitstatus_to_exitcode(wstatus)
            code = 128 - code if code < 0 else code
        return ExecResult(out, err, code, timed_out, time.monotonic() - t0)

    def read_file(self, sid: str, path: str) -> bytes:
        sb = self._get(sid)
        with self._root(sb) as root:
            fd = self._open(root, path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise BadRequest(f"{path}: not a regular file")
                if st.st_size > MAX_FILE_BYTES:
                    raise TooLarge(f"{path}: {st.st_size} bytes > {MAX_FILE_BYTES}")
                chunks, n = [], 0
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
                    n += len(chunk)
                    if n > MAX_FILE_BYTES:
                        raise TooLarge(f"{path}: more than {MAX_FILE_BYTES} bytes")
                return b"".join(chunks)
            finally:
                os.close(fd)

    def write_file(self, sid: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or replace a file (parents are created, mode 0755), owned by root, with `mode`."""
        sb = self._get(sid)
        cap = min(MAX_FILE_BYTES, sb.limits.file_mb * 1024 * 1024)
        if len(data) > cap:
            raise TooLarge(f"{len(data)} bytes > {cap}")
        try:
            p = _fs.norm(path)
        except ValueError as e:
            raise BadRequest(str(e)) from e
        if p == "/":
            raise BadRequest("cannot write to /")
        with self._root(sb) as root:
            parent = os.path.dirname(p)
            try:
                os.close(_fs.makedirs_in_root(root, parent))
            except OSError as e:
                raise BadRequest(f"{parent}: {e.strerror}") from e
            fd = self._open(root, p, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, mode & 0o7777)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device: never write to it
                    raise BadRequest(f"{path}: not a regular file")
                os.ftruncate(fd, 0)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchown(fd, 0, 0)
                os.fchmod(fd, mode & 0o7777)
            except OSError as e:
                raise (TooLarge if e.errno in (errno.ENOSPC, errno.EDQUOT) else BadRequest)(
                    f"{path}: {e.strerror}") from e
            finally:
                os.close(fd)

    def list_files(self, sid: str, path: str) -> list[FileInfo]:
        sb = self._get(sid)
        with self._root(sb) as root:
            fd = self._open(root, path, os.O_RDONLY | os.O_DIRECTORY)
            base = _fs.norm(path)
            out = []
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        out.append(FileInfo(e.name, os.path.join(base, e.name), stat.S_ISDIR(st.st_mode), st.st_size))
            finally:
                os.close(fd)
        return sorted(out, key=lambda f: f.name)

    # internals -----------------------------------------------------------------------------------------------
    def _get(self, sid: str) -> _Sandbox:
        _check_id("sandbox id", sid)
        sb = self._table.sandboxes.get(sid)
        if sb is None:
            raise NotFound(f"sandbox {sid} not found")
        return sb

    def _cgroups_of(self, sid: str) -> list[Path]:
        return cgroup_dirs(f"{sid}-{self._tag}")

    @staticmethod
    def _freezer(sb: _Sandbox) -> Path:
        return freezer_dir(sb.cgroups)

    def _load(self, sid: str, meta: dict) -> _Sandbox | None:
        """A _Sandbox from sandboxes/<sid>/run.json (the tier's own, newest record), else from `meta`."""
        sdir = self.state_dir / "sandboxes" / sid
        if not sdir.is_dir():
            return None
        try:
            rec = json.loads((sdir / "run.json").read_text())
        except (OSError, ValueError):
            rec = dict(meta or {})
        if not rec.get("base"):
            return None
        sb = _Sandbox(sid, sdir, rec["base"], rec.get("binds", []), rec.get("layers", []),
                      Limits.from_record(rec.get("limits", {})), rec.get("env", {}), self._cgroups_of(sid),
                      State(rec.get("state", "running")))
        sb.init_pid, sb.init_start = rec.get("init_pid", 0), rec.get("init_start", 0)
        return sb

    def _setup_cgroups(self, sb: _Sandbox) -> None:
        lim = sb.limits
        cg_setup(sb.cgroups, max(16, int(lim.memory_mb)) * 1024 * 1024, max(1, int(lim.pids)) + PIDS_OVERHEAD,
                 lim.cpus)

    def _start(self, sb: _Sandbox, timeout: float = 20.0, setup_cgroups: bool = True) -> None:
        """Start an init over sb's layer stack (a warm one from the pool if there is one) and wait until it is
        ready."""
        if setup_cgroups:
            self._setup_cgroups(sb)
        _cg_freeze(self._freezer(sb), False)
        rel = lambda p: os.path.relpath(p, self.state_dir) if _under(p, self.state_dir) else str(p)  # noqa: E731
        cfg = {"cwd": str(self.state_dir), "root": str(sb.root), "upper": rel(sb.upper), "work": rel(sb.work),
               "lowers": [rel(p) for p in sb.layers + [sb.base]], "options": OVERLAY_OPTIONS, "binds": sb.binds,
               "hostname": sb.sid[:63], "netns": not sb.limits.network, "shm": f"{max(1, sb.limits.memory_mb // 2)}m"}
        pool = self._table.pool
        w = pool.take(cfg["netns"])
        try:
            w = w or _Warm.spawn(self._unshare, cfg["netns"], timeout)
            # Into the sandbox's cgroups before it gets its config: the unshare (blocked in wait) and the
            # init (blocked on ctl): neither forks before that, so nothing of the sandbox runs outside them.
            try:
                for d in sb.cgroups:
                    for pid in (w.proc.pid, w.init_pid):
                        _write(d / "cgroup.procs", str(pid))
            except OSError as e:
                raise SandboxError(f"sandbox {sb.sid} failed to start: cannot join {d}: {e.strerror}") from e
            with open(sb.dir / "init.log", "ab") as log:
                socket.send_fds(w.ctl, [marshal.dumps(cfg)], [log.fileno()])
            line = _read_line(w.st_r, timeout)
            if line == "ok":
                sb.proc, sb.ctl, sb.init_pid, sb.init_start = w.proc, w.ctl, w.init_pid, w.init_start
                w.proc = w.ctl = None
                for name in ("uid_map", "gid_map"):  # identity map: root inside is root, capabilities stay inside
                    _write(Path(f"/proc/{sb.init_pid}/{name}"), "0 0 4294967295\n")
                sb.ctl.send(b"g")
                line = _read_line(w.st_r, timeout)
        finally:
            if w is not None:
                w.kill()  # what is left of it: the status pipe (and all of it if it did not become sb's)
            pool.done()
        if line != "ready":
            tail = (sb.dir / "init.log").read_text(errors="replace")[-2000:] if not line else ""
            sb.stop()
            raise SandboxError(f"sandbox {sb.sid} failed to start: {line[4:] or 'no answer'} {tail}".strip())

    def _restart(self, sb: _Sandbox, state: State, setup_cgroups: bool = True) -> None:
        """(Re)start a stopped sandbox's init with a clean workdir; freeze it again if `state` is paused.
        setup_cgroups=False: its cgroups are there, with its limits (a checkpoint)."""
        _rmtree(sb.work)
        sb.work.mkdir()
        sb.state = State.RUNNING
        self._start(sb, setup_cgroups=setup_cgroups)
        if state is State.PAUSED:
            _cg_freeze(self._freezer(sb), True)
            sb.state = State.PAUSED
        sb.save()

    @contextlib.contextmanager
    def _root(self, sb: _Sandbox):
        """An O_PATH fd of the sandbox root as its processes see it (via /proc/<init>/root)."""
        pid, start = sb.init_pid, sb.init_start
        try:
            pdir = os.open(f"/proc/{pid}", os.O_PATH | os.O_DIRECTORY) if pid else -1
        except OSError:
            pdir = -1
        try:
            if pdir < 0 or _proc_start(pid) != start or not sb.alive():
                raise SandboxError(f"sandbox {sb.sid} is not running (its init is gone)")
            fd = os.open("root", os.O_PATH | os.O_DIRECTORY, dir_fd=pdir)
        finally:
            if pdir >= 0:
                os.close(pdir)
        try:
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _open(root: int, path: str, flags: int, mode: int = 0) -> int:
        try:
            return _fs.open_in_root(root, path, flags, mode)
        except ValueError as e:
            raise BadRequest(str(e)) from e
        except FileNotFoundError as e:
            raise NotFound(f"{path}: no such file or directory") from e
        except OSError as e:
            if e.errno == errno.EROFS:
                raise BadRequest(f"{path}: read-only file system") from e
            raise BadRequest(f"{path}: {e.strerror}") from e

    def _default_env(self, sb: _Sandbox) -> dict[str, str]:
        path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        py = next((dst for src, dst in sb.binds if src == _py_prefix()), None)
        return {"PATH": f"/{py.strip('/')}/bin:{path}" if py else path, "HOME": "/root", "LANG": "C.UTF-8",
                "HOSTNAME": sb.sid[:63]}

    # bases and layers ------------------------------------------------------------------------------------------
    def _resolve_base(self, base: str | None) -> tuple[str, list]:
        """(base directory, read-only binds) for None/"default", a name under bases/, or a directory or tarball
        under one of the operator's base roots (the allow-list of bases.py; BadRequest for anything else)."""
        if base in (None, "", "default"):
            return self._default_base()
        if not isinstance(base, str) or "\0" in base:
            raise BadRequest(f"base must be a string without NUL, got {base!r}")
        if os.path.isabs(base):
            p = allowed_base_path(base, self.base_roots, self.state_dir)
        else:
            _check_id("base", base)
            p = self.state_dir / "bases" / base
        if p.is_dir():
            d = str(p.resolve())
            if d == "/":
                raise BadRequest("the host root cannot be a base")
            return d, []
        if p.is_file():
            return self._extract(p), []
        raise NotFound(f"base {base} not found")

    def _default_base(self) -> tuple[str, list]:
        """A skeleton root (mount points, /bin→usr/bin-style symlinks as on the host, a minimal /etc) plus
        read-only binds of the host's /usr (and any top-level lib/bin dirs that are not symlinks) and of the
        running Python's prefix (at the same path, so its compiled-in paths work). Nothing else of the host."""
        prefix = _py_prefix()
        binds = [["/usr", "usr"]]
        layout = []
        for name in _BASE_TOP:
            host = Path("/") / name
            if host.is_symlink():
                layout.append((name, os.readlink(host)))
            elif host.is_dir():
                layout.append((name, None))
                binds.append([str(host), name])
        if not (prefix + "/").startswith("/usr/"):
            binds.append([prefix, prefix.lstrip("/")])
        key = hashlib.sha1(json.dumps([1, layout, binds]).encode()).hexdigest()[:12]
        d = self.state_dir / "bases" / f"default-{key}"
        with self._base_lock:
            if not d.is_dir():
                tmp = d.with_name(f".{d.name}.{os.getpid()}")
                _rmtree(tmp)
                _build_default_base(tmp, layout, binds)
                try:
                    os.rename(tmp, d)
                except OSError:  # another process won the race
                    _rmtree(tmp)
        return str(d), binds

    def _extract(self, tarball: Path) -> str:
        h = hashlib.sha256()
        with open(tarball, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        d = self.state_dir / "bases" / h.hexdigest()
        with self._base_lock:
            if not d.is_dir():
                tmp = d.with_name(f".{d.name}.{os.getpid()}")
                _rmtree(tmp)
                tmp.mkdir()

                def keep_mode(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
                    if member.isdev():  # device nodes: none in a base (the overlay is nodev anyway)
                        return None
                    return tarfile.tar_filter(member, dest).replace(mode=member.mode, deep=False)  # safe paths

                try:
                    with tarfile.open(tarball) as tf:
                        tf.extractall(tmp, numeric_owner=True, filter=keep_mode)
                except (tarfile.TarError, OSError) as e:
                    _rmtree(tmp)
                    raise BadRequest(f"base tarball {tarball}: {e}") from e
                os.chmod(tmp, 0o755)
                os.rename(tmp, d)
        return str(d)

    def _gc_layers(self) -> None:
        """Delete tombstoned layers that no live snapshot or sandbox stacks any more."""
        layers = self.state_dir / "layers"
        with self._gc_lock:
            dead = {p.name[1:-len(".deleted")] for p in layers.glob(".*.deleted")}
            if not dead:
                return
            used: set[str] = set()
            for j in layers.glob(".*.json"):
                if j.name[1:-len(".json")] not in dead:
                    used.update(_json(j).get("layers", []))
            for r in (self.state_dir / "sandboxes").glob("*/run.json"):
                used.update(_json(r).get("layers", []))
            for snap_id in dead:
                if str(layers / snap_id) not in used:
                    _rmtree(layers / snap_id)
                    for meta in (f".{snap_id}.json", f".{snap_id}.deleted"):
                        (layers / meta).unlink(missing_ok=True)



# --- helpers ------------------------------------------------------------------------------------------------------
def _under(path, parent) -> bool:
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(parent)]) == os.path.abspath(parent)


def _json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def _reap(pid: int) -> None:
    """Reap `pid` if it is our (orphan-adopted) child; a no-op otherwise."""
    if pid:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def _check_env(env: dict) -> dict[str, str]:
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k or "\0" in k + v:
            raise BadRequest(f"invalid environment variable {k!r}")
    return dict(env)


def _read_line(fd: int, timeout: float) -> str:
    """One line from a pipe, or what came before EOF/timeout."""
    buf, deadline = b"", time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


def _communicate(sock: socket.socket, stdin_w: int, out_r: int, err_r: int, data: bytes,
                 deadline: float) -> tuple[str, str, int | None, bool]:
    """Feed stdin and collect capped stdout/stderr until the init reports the command's wait status on `sock`
    (then drain what is buffered: background children that keep the pipes open do not hold us up). At the
    deadline ask the init to kill the command's session ("k") and wait a little for the status.
    Returns (stdout, stderr, wait status or None if the init went away, timed_out). Closes every fd."""
    bufs, dropped, eof = {out_r: bytearray(), err_r: bytearray()}, {out_r: 0, err_r: 0}, set()
    sel = selectors.DefaultSelector()
    for fd in (out_r, err_r):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    sock.setblocking(False)
    sel.register(sock, selectors.EVENT_READ)
    view = memoryview(data)
    if view:
        os.set_blocking(stdin_w, False)
        sel.register(stdin_w, selectors.EVENT_WRITE)
    else:
        os.close(stdin_w)
        stdin_w = -1

    def read(fd: int) -> bool:  # False at EOF or when the pipe is empty
        if fd in eof:
            return False
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            eof.add(fd)
            sel.unregister(fd)
            return False
        room = max(MAX_OUTPUT_BYTES - len(bufs[fd]), 0)
        bufs[fd] += chunk[:room]
        dropped[fd] += len(chunk) - min(room, len(chunk))
        return True

    reply, timed_out, wstatus, note = b"", False, None, ""
    try:
        while b"\n" not in reply:
            left = deadline - time.monotonic()
            if left <= 0:
                if timed_out:
                    break  # killed but no status (frozen meanwhile?): give up waiting
                timed_out, deadline = True, time.monotonic() + 5.0
                try:
                    sock.send(b"k")
                except OSError:
                    pass
                continue
            for key, _ in sel.select(left):
                if key.fileobj is sock:
                    try:
                        chunk = sock.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        chunk = b""
                    if not chunk:
                        reply += b"\n"  # EOF: the init is gone
                    reply += chunk
                elif key.fileobj == stdin_w:
                    try:
                        view = view[os.write(stdin_w, view[:1 << 16]):]
                    except BlockingIOError:
                        pass
                    except BrokenPipeError:
                        view = view[:0]
                    if not view:
                        sel.unregister(stdin_w)
                        os.close(stdin_w)
                        stdin_w = -1
                else:
                    read(key.fileobj)
        line = reply.split(b"\n", 1)[0].decode(errors="replace")
        if line.startswith("x "):
            wstatus = int(line[2:])
        elif line.startswith("e "):
            wstatus, note = 126 << 8, f"k3: cannot start the command: {line[2:]}\n"
        for fd in (out_r, err_r):  # what the command wrote before it exited is in the pipes now
            while read(fd):
                pass
    finally:
        sel.close()
        sock.close()  # if the command still runs, the init kills its session on this EOF
        for fd in (out_r, err_r, stdin_w):
            if fd >= 0:
                os.close(fd)
    out, err = bufs[out_r].decode(errors="replace"), note + bufs[err_r].decode(errors="replace")
    for fd, name in ((out_r, "stdout"), (err_r, "stderr")):
        if dropped[fd]:
            err += f"\n[k3: {name} truncated: {dropped[fd]} bytes beyond {MAX_OUTPUT_BYTES} dropped]"
    return out, err, wstatus, timed_out
