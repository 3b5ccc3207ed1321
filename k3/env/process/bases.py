"""Bases of the process tier: the default skeleton root, and which other bases a request may name.

A base is "default" (built here), a name under the tier's bases/ directory (put there by the operator, or a
tarball extracted there earlier), or an absolute path (directory or tarball) strictly under one of the operator's
base roots: `ProcessTier(base_roots=...)` or $K3_SANDBOX_BASE_ROOTS (paths separated by ':'). Nothing else of the
host can be a base: not /, not /etc, not /proc/1/root, not the tier's own sandboxes or layers.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from ..base import BadRequest

BASE_ROOTS_ENV = "K3_SANDBOX_BASE_ROOTS"
_BASE_TOP = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_ETC_COPY = ("nsswitch.conf", "resolv.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ssl", "alternatives",
             "os-release", "debian_version", "profile", "bash.bashrc", "shells", "localtime", "timezone",
             "mime.types", "protocols", "services", "inputrc", "ca-certificates.conf", "environment")


def base_roots_from_env() -> list[str]:
    """The operator's base roots from $K3_SANDBOX_BASE_ROOTS (empty: none)."""
    return [p for p in os.environ.get(BASE_ROOTS_ENV, "").split(os.pathsep) if p.strip()]


def _inside(path: str, parent: str) -> bool:
    return path != parent and os.path.commonpath([path, parent]) == parent


def allowed_base_path(base: str, roots: list[str], state_dir: Path) -> Path:
    """`base` (an absolute path) with symlinks resolved, if it lies strictly under one of `roots` and not in the
    tier's state dir; BadRequest naming the allowed forms otherwise."""
    try:
        real = os.path.realpath(base)
    except OSError:  # e.g. /proc/1/root of a process we may not look into: not a base either way
        real = None
    private = os.path.realpath(state_dir)
    for root in roots if real is not None else ():
        r = os.path.realpath(root)
        if r != "/" and _inside(real, r) and not (real == private or _inside(real, private)):
            return Path(real)
    raise BadRequest(f"base {base!r} is not allowed: a base is 'default', a name under {state_dir / 'bases'}, or "
                     f"a path under one of the operator's base roots (${BASE_ROOTS_ENV}: "
                     f"{os.pathsep.join(roots) if roots else 'none set'})")


def _py_prefix() -> str:
    return os.path.realpath(sys.base_prefix)


def _build_default_base(d: Path, layout: list, binds: list) -> None:
    d.mkdir(parents=True)
    os.chmod(d, 0o755)
    for sub, mode in (("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("tmp", 0o1777), ("root", 0o700),
                      ("home", 0o755), ("run", 0o755), ("mnt", 0o755), ("opt", 0o755), ("srv", 0o755),
                      ("var", 0o755), ("var/tmp", 0o1777), ("var/log", 0o755), ("usr", 0o755), ("etc", 0o755)):
        (d / sub).mkdir(exist_ok=True)
        os.chmod(d / sub, mode)
    for name, target in layout:
        if target is not None:
            os.symlink(target, d / name)
    for _, dst in binds:
        (d / dst).mkdir(parents=True, exist_ok=True)
    etc = d / "etc"
    for name in _ETC_COPY:
        src = Path("/etc") / name
        try:
            if src.is_symlink():
                os.symlink(os.readlink(src), etc / name)
            elif src.is_dir():
                shutil.copytree(src, etc / name, symlinks=True)
            elif src.is_file():
                shutil.copy2(src, etc / name)
        except OSError:
            pass
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    (etc / "group").write_text("root:x:0:\ntty:x:5:\nnogroup:x:65534:\n")
    (etc / "hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
    (etc / "hostname").write_text("sandbox\n")
