"""Low-level Linux helpers for the process tier: confined path resolution (openat2) and mount syscalls.

Standard library only: the process tier's sandbox init imports this file by path (`python -I -S`), before any
of the `k3` package is importable.

Path safety: every path a sandbox controls is resolved with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`
relative to a directory fd for the sandbox root, so `..` and absolute symlink targets can never leave it
(the kernel re-roots them), and /proc magic links are refused.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

_NR = {  # syscall numbers that glibc does not wrap (or wraps only in newer versions)
    "x86_64": {"pivot_root": 155, "openat2": 437},
    "aarch64": {"pivot_root": 41, "openat2": 437},
}.get(os.uname().machine, {"openat2": 437})  # (other architectures: no pivot_root number here)

# openat2 resolve flags
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

# mount flags
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2

MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_AT_EMPTY_PATH = 0x1000
_MOVE_MOUNT_F_EMPTY_PATH, _MOVE_MOUNT_T_EMPTY_PATH = 0x4, 0x40

CLONE_NEWUSER, CLONE_NEWCGROUP = 0x10000000, 0x02000000
PR_SET_DUMPABLE = 4


def _syscall(nr: int, *args) -> int:
    """syscall(2) with integer arguments passed as C longs (variadic: a plain int would be 32 bits)."""
    return _libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


# --- confined path resolution ----------------------------------------------------------------------------
def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2); O_CLOEXEC is always added. Retries EAGAIN (a concurrent rename raced the lookup)."""
    how = struct.pack("QQQ", flags | os.O_CLOEXEC, mode, resolve)
    for _ in range(64):
        fd = _syscall(_NR["openat2"], dirfd, os.fsencode(path), how, len(how))
        if fd >= 0:
            return fd
        e = ctypes.get_errno()
        if e != errno.EAGAIN:
            raise OSError(e, os.strerror(e), path)
    raise OSError(errno.EAGAIN, "openat2: too many retries", path)


def norm(path: str) -> str:
    """Normalise a sandbox path to an absolute one ('/'-rooted, no '.', '..' or empty parts). A relative
    path is taken from '/'. Raises ValueError for NUL bytes or a `..` that climbs above the root."""
    if not isinstance(path, str) or "\0" in path:
        raise ValueError("invalid path")
    parts: list[str] = []
    for p in path.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            if not parts:
                raise ValueError(f"path escapes the sandbox root: {path!r}")
            parts.pop()
        else:
            parts.append(p)
    return "/" + "/".join(parts)


def open_in_root(root_fd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """Open `path` (a sandbox path) with `root_fd` as '/': symlinks, absolute or not, stay inside."""
    return openat2(root_fd, norm(path).lstrip("/") or ".", flags, mode,
                   RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | resolve)


def makedirs_in_root(root_fd: int, path: str, mode: int = 0o755, resolve: int = 0) -> int:
    """mkdir -p inside the root; returns an O_PATH fd of the final directory (caller closes)."""
    cur = os.dup(root_fd)
    try:
        done = ""
        for part in norm(path).strip("/").split("/"):
            if not part:
                continue
            done += "/" + part
            try:
                os.mkdir(part, mode, dir_fd=cur)
            except FileExistsError:
                pass
            nxt = open_in_root(root_fd, done, os.O_PATH | os.O_DIRECTORY, resolve=resolve)
            os.close(cur)
            cur = nxt
        return cur
    except BaseException:
        os.close(cur)
        raise


def fd_path(fd: int) -> str:
    """A path that names exactly what `fd` refers to (for syscalls that only take paths, e.g. mount)."""
    return f"/proc/self/fd/{fd}"


# --- namespaces and mounts ---------------------------------------------------------------------------------
def mount(source: str | None, target: str, fstype: str | None = None, flags: int = 0,
          data: str | None = None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source} on {target} ({fstype})")


def umount2(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(os.fsencode(target), flags), f"umount {target}")


def bind_ro(src_fd: int, dst_fd: int, nosuid: bool = False) -> None:
    """Read-only, non-recursive bind mount of what src_fd names onto what dst_fd names. The clone is made
    read-only before it is attached (open_tree + mount_setattr + move_mount), so it is never writable."""
    tree = _check(_syscall(428, src_fd, b"", 1 | os.O_CLOEXEC | _AT_EMPTY_PATH), "open_tree")  # CLONE
    try:
        attr = struct.pack("QQQQ", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV | (MOUNT_ATTR_NOSUID if nosuid else 0),
                           0, 0, 0)
        _check(_syscall(442, tree, b"", _AT_EMPTY_PATH, attr, len(attr)), "mount_setattr")
        _check(_syscall(429, tree, b"", dst_fd, b"", _MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH),
               "move_mount")
    finally:
        os.close(tree)


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_syscall(_NR["pivot_root"], os.fsencode(new_root), os.fsencode(put_old)), "pivot_root")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def set_dumpable(on: bool) -> None:
    _check(_libc.prctl(PR_SET_DUMPABLE, int(on), 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def sethostname(name: str) -> None:
    b = name.encode()
    _check(_libc.sethostname(b, len(b)), "sethostname")


def link_up(name: str = "lo") -> None:
    """Bring a network interface up (SIOCGIFFLAGS / SIOCSIFFLAGS on a throw-away socket)."""
    fd = _check(_libc.socket(2, 2 | os.O_CLOEXEC, 0), "socket")  # AF_INET, SOCK_DGRAM
    try:
        ifr = ctypes.create_string_buffer(struct.pack("16sH22x", name.encode(), 0), 40)
        _check(_libc.ioctl(fd, 0x8913, ifr), f"SIOCGIFFLAGS {name}")
        struct.pack_into("H", ifr, 16, struct.unpack_from("H", ifr, 16)[0] | 0x1)  # IFF_UP
        _check(_libc.ioctl(fd, 0x8914, ifr), f"SIOCSIFFLAGS {name}")
    finally:
        os.close(fd)


# --- overlayfs through the new mount API (no option-string length limit: one fsconfig call per layer) --------
_FSCONFIG_SET_FLAG, _FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 0, 1, 6


def _fs_error(ctx: int) -> str:
    """The kernel's own message for a failed fsconfig (read from the fs context fd)."""
    msgs = []
    while True:
        try:
            msgs.append(os.read(ctx, 4096).decode(errors="replace"))
        except OSError:
            return "; ".join(msgs)


def mount_overlay(target: str, lowers: list[str], upper: str, work: str, options: dict[str, str]) -> None:
    """Mount overlayfs (nodev) on `target` with `lowers` newest (top) first. Uses the new mount API with one
    "lowerdir+" per layer (Linux >= 6.8: no limit on the stack's total path length); falls back to mount(2)
    with one option string (at most a page long) on older kernels."""
    nr = {"fsopen": 430, "fsconfig": 431, "fsmount": 432, "move_mount": 429}
    ctx = _syscall(nr["fsopen"], b"overlay", 1)  # FSOPEN_CLOEXEC
    if ctx >= 0:
        try:
            def cfg(key: str, value: str | None = None) -> None:
                cmd = _FSCONFIG_SET_FLAG if value is None else _FSCONFIG_SET_STRING
                val = None if value is None else os.fsencode(value)
                if _syscall(nr["fsconfig"], ctx, cmd, key.encode(), val, 0) < 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"overlay {key}={value}: {os.strerror(e)} {_fs_error(ctx)}")

            try:
                cfg("lowerdir+", lowers[0])
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                os.close(ctx)  # no "lowerdir+" before Linux 6.8
                ctx = -1
        except BaseException:
            if ctx >= 0:
                os.close(ctx)
            raise
    if ctx < 0:
        opts = ",".join([f"lowerdir={':'.join(lowers)}", f"upperdir={upper}", f"workdir={work}"]
                        + [f"{k}={v}" for k, v in options.items()])
        return mount("overlay", target, "overlay", MS_NODEV, opts)
    try:
        for d in lowers[1:]:
            cfg("lowerdir+", d)
        cfg("upperdir", upper)
        cfg("workdir", work)
        for k, v in options.items():
            cfg(k, v)
        if _syscall(nr["fsconfig"], ctx, _FSCONFIG_CMD_CREATE, None, None, 0) < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"overlay create: {os.strerror(e)} {_fs_error(ctx)}")
        mfd = _check(_syscall(nr["fsmount"], ctx, 1, MOUNT_ATTR_NODEV), "fsmount")  # FSMOUNT_CLOEXEC
        try:
            _check(_syscall(nr["move_mount"], mfd, b"", -100, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH),
                   f"move_mount {target}")  # -100: AT_FDCWD
        finally:
            os.close(mfd)
    finally:
        os.close(ctx)
