"""`Sandbox`: the Python client, in-process (over a `SandboxManager`) or remote (over the REST server).

    from k3.env import Sandbox
    with Sandbox.create() as sb:                     # tier "process", default base
        r = sb.exec("echo hi")                       # ExecResult(stdout="hi\\n", stderr="", exit_code=0, …)
        sb.write_file("/work/a.txt", b"data")
        snap = sb.checkpoint()                       # "snap-…"
        kids = sb.fork(3)                            # three independent copies
    again = Sandbox.restore(snap)

Transport: `url=` (or $K3_SANDBOX_URL) selects the remote server, with `api_key=` (or $K3_SANDBOX_API_KEY);
otherwise `manager=` or the process-wide default manager (state dir $K3_SANDBOX_DIR or
~/.cache/k3/sandboxes). Both raise the same `k3.env.base` errors (remote: mapped from the HTTP answer;
401 → `AuthError`; an unreachable server → `Unavailable`).
"""

from __future__ import annotations

import base64
import os
from typing import Any

from . import base as _base
from .base import MAX_FILE_BYTES, BadRequest, ExecResult, FileInfo, NotFound, SandboxError, TooLarge, Unavailable
from .manager import SandboxManager, default_manager


class AuthError(SandboxError):
    """Missing or wrong API key (HTTP 401)."""

    status = 401


_BY_NAME = {c.__name__: c for c in (_base.BadRequest, _base.NotFound, _base.InvalidState, _base.TooLarge,
                                    _base.Unavailable, _base.SandboxError, AuthError)}
_BY_NAME["Unauthorized"] = AuthError
_BY_STATUS = {400: _base.BadRequest, 401: AuthError, 404: _base.NotFound, 409: _base.InvalidState,
              413: _base.TooLarge, 415: _base.BadRequest, 422: _base.BadRequest, 503: _base.Unavailable}


# ---- transports: the same operations, returning plain dicts / bytes ----------------------------------------
class _Local:
    def __init__(self, manager: SandboxManager):
        self.m = manager

    def create(self, **kw) -> dict:
        return self.m.create(**kw)

    def get(self, sid: str) -> dict:
        return self.m.get(sid)

    def list(self) -> list[dict]:
        return self.m.list()

    def kill(self, sid: str) -> None:
        self.m.kill(sid)

    def pause(self, sid: str) -> dict:
        return self.m.pause(sid)

    def resume(self, sid: str) -> dict:
        return self.m.resume(sid)

    def set_timeout(self, sid: str, timeout_s: float | None) -> dict:
        return self.m.set_timeout(sid, timeout_s)

    def checkpoint(self, sid: str) -> dict:
        return self.m.checkpoint(sid)

    def fork(self, sid: str, count: int) -> dict:
        return self.m.fork(sid, count)

    def exec(self, sid: str, cmd, timeout, env, cwd, stdin) -> dict:
        return self.m.exec(sid, cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin).to_dict()

    def read_file(self, sid: str, path: str) -> bytes:
        return self.m.read_file(sid, path)

    def write_file(self, sid: str, path: str, data: bytes, mode: int) -> None:
        self.m.write_file(sid, path, data, mode=mode)

    def list_files(self, sid: str, path: str) -> list[dict]:
        return [vars(f) for f in self.m.list_files(sid, path)]

    def list_snapshots(self) -> list[dict]:
        return self.m.list_snapshots()

    def get_snapshot(self, snap_id: str) -> dict:
        return self.m.get_snapshot(snap_id)

    def delete_snapshot(self, snap_id: str) -> None:
        self.m.delete_snapshot(snap_id)

    def close(self) -> None:
        pass


class _Remote:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 60.0):
        import httpx
        self.url = url.rstrip("/")
        headers = {"X-API-Key": api_key} if api_key else {}
        self.timeout = timeout
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def _req(self, method: str, path: str, *, timeout: float | None = None, **kw):
        import httpx
        try:
            r = self.http.request(method, path, timeout=timeout if timeout is not None else self.timeout, **kw)
        except httpx.TransportError as e:
            raise Unavailable(f"sandbox server {self.url} unreachable: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            raise _http_error(r)
        return r

    def _json(self, method: str, path: str, **kw) -> Any:
        r = self._req(method, path, **kw)
        return r.json() if r.status_code != 204 and r.content else None

    def create(self, **kw) -> dict:
        body = {k: v for k, v in kw.items() if v is not None}
        if "limits" in body and not isinstance(body["limits"], dict):
            body["limits"] = vars(body["limits"])
        return self._json("POST", "/sandboxes", json=body)

    def get(self, sid: str) -> dict:
        return self._json("GET", f"/sandboxes/{sid}")

    def list(self) -> list[dict]:
        return self._json("GET", "/sandboxes")

    def kill(self, sid: str) -> None:
        self._req("DELETE", f"/sandboxes/{sid}")

    def pause(self, sid: str) -> dict:
        return self._json("POST", f"/sandboxes/{sid}/pause")

    def resume(self, sid: str) -> dict:
        return self._json("POST", f"/sandboxes/{sid}/resume")

    def set_timeout(self, sid: str, timeout_s: float | None) -> dict:
        return self._json("POST", f"/sandboxes/{sid}/timeout", json={"timeout_s": timeout_s})

    def checkpoint(self, sid: str) -> dict:
        return self._json("POST", f"/sandboxes/{sid}/snapshots", timeout=max(self.timeout, 600.0))

    def fork(self, sid: str, count: int) -> dict:
        return self._json("POST", f"/sandboxes/{sid}/fork", json={"count": count}, timeout=max(self.timeout, 600.0))

    def exec(self, sid: str, cmd, timeout, env, cwd, stdin) -> dict:
        body: dict[str, Any] = {"cmd": cmd, "timeout": timeout}
        if env is not None:
            body["env"] = env
        if cwd is not None:
            body["cwd"] = cwd
        if stdin is not None:
            body["stdin_b64"] = base64.b64encode(stdin).decode()
        # the HTTP request must outlive the command's own timeout
        return self._json("POST", f"/sandboxes/{sid}/exec", json=body, timeout=float(timeout) + 30.0)

    def read_file(self, sid: str, path: str) -> bytes:
        return self._req("GET", f"/sandboxes/{sid}/files", params={"path": path}).content

    def write_file(self, sid: str, path: str, data: bytes, mode: int) -> None:
        self._req("PUT", f"/sandboxes/{sid}/files", params={"path": path, "mode": format(mode, "o")},
                  content=data, headers={"Content-Type": "application/octet-stream"})

    def list_files(self, sid: str, path: str) -> list[dict]:
        return self._json("GET", f"/sandboxes/{sid}/files/list", params={"path": path})

    def list_snapshots(self) -> list[dict]:
        return self._json("GET", "/snapshots")

    def get_snapshot(self, snap_id: str) -> dict:
        return self._json("GET", f"/snapshots/{snap_id}")

    def delete_snapshot(self, snap_id: str) -> None:
        self._req("DELETE", f"/snapshots/{snap_id}")

    def close(self) -> None:
        self.http.close()


def _http_error(r) -> SandboxError:
    try:
        body = r.json()
        name, detail = body.get("error"), body.get("detail")
    except Exception:  # noqa: BLE001 - not our JSON (a proxy's error page, …)
        name, detail = None, r.text[:500]
    cls = _BY_NAME.get(name)
    cls = cls or _BY_STATUS.get(r.status_code, SandboxError)
    if not isinstance(detail, str):
        detail = str(detail)
    err = cls(detail or f"HTTP {r.status_code}")
    err.status = r.status_code
    return err


def _transport(url: str | None, api_key: str | None, manager: SandboxManager | None):
    url = url if url is not None else os.environ.get("K3_SANDBOX_URL") or None
    if url:
        if manager is not None:
            raise BadRequest("give either url or manager, not both")
        key = api_key if api_key is not None else os.environ.get("K3_SANDBOX_API_KEY") or None
        return _Remote(url, key)
    return _Local(manager if manager is not None else default_manager())


class Sandbox:
    """A handle on one sandbox. Build with `create`, `restore`, `connect`, `list` or `fork`, not directly."""

    def __init__(self, sandbox_id: str, transport, info: dict | None = None):
        self.sandbox_id = sandbox_id
        self._t = transport
        self.info: dict = info or {}

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def create(cls, tier: str | None = "process", base: str | None = None, *, snapshot_id: str | None = None,
               timeout_s: float | None = None, auto_pause: bool = True, limits: Any = None,
               env: dict[str, str] | None = None, metadata: dict[str, str] | None = None,
               url: str | None = None, api_key: str | None = None,
               manager: SandboxManager | None = None) -> Sandbox:
        """Start a sandbox. `limits`: a `k3.env.Limits` or a dict of some of its fields. `timeout_s`: TTL
        after which it is paused (`auto_pause=True`) or killed. Remote with `url`/$K3_SANDBOX_URL."""
        t = _transport(url, api_key, manager)
        if limits is not None and not isinstance(limits, dict):
            limits = dict(vars(limits))
        info = t.create(tier=tier, base=base, snapshot_id=snapshot_id, timeout_s=timeout_s, auto_pause=auto_pause,
                        limits=limits, env=env, metadata=metadata)
        return cls(info["sandbox_id"], t, info)

    @classmethod
    def restore(cls, snapshot_id: str, **kw) -> Sandbox:
        """A new sandbox from a snapshot (its tier); same keywords as `create` (no `base`)."""
        kw.setdefault("tier", None)
        return cls.create(snapshot_id=snapshot_id, **kw)

    @classmethod
    def connect(cls, sandbox_id: str, *, url: str | None = None, api_key: str | None = None,
                manager: SandboxManager | None = None) -> Sandbox:
        """A handle on an existing sandbox (NotFound if there is none). Does not resume a paused one."""
        t = _transport(url, api_key, manager)
        return cls(sandbox_id, t, t.get(sandbox_id))

    @classmethod
    def list(cls, *, url: str | None = None, api_key: str | None = None,
             manager: SandboxManager | None = None) -> list[Sandbox]:
        """Every live sandbox (running or paused); each handle's `.info` holds its listing."""
        t = _transport(url, api_key, manager)
        return [cls(i["sandbox_id"], t, i) for i in t.list()]

    @classmethod
    def snapshots(cls, *, url: str | None = None, api_key: str | None = None,
                  manager: SandboxManager | None = None) -> list[dict]:
        return _transport(url, api_key, manager).list_snapshots()

    @classmethod
    def delete_snapshot(cls, snapshot_id: str, *, url: str | None = None, api_key: str | None = None,
                        manager: SandboxManager | None = None) -> None:
        _transport(url, api_key, manager).delete_snapshot(snapshot_id)

    # ---- state --------------------------------------------------------------------------------------
    def refresh(self) -> dict:
        self.info = self._t.get(self.sandbox_id)
        return self.info

    @property
    def state(self) -> str:
        """"running" or "paused" (fetched now)."""
        return self.refresh()["state"]

    @property
    def tier(self) -> str | None:
        return self.info.get("tier")

    def pause(self) -> None:
        self.info = self._t.pause(self.sandbox_id)

    def resume(self) -> None:
        self.info = self._t.resume(self.sandbox_id)

    def set_timeout(self, timeout_s: float | None) -> None:
        """TTL from now (None: never expires)."""
        self.info = self._t.set_timeout(self.sandbox_id, timeout_s)

    def checkpoint(self) -> str:
        """Seal the current state as a snapshot; returns its id (restore with `Sandbox.restore`)."""
        return self._t.checkpoint(self.sandbox_id)["snapshot_id"]

    def fork(self, n: int = 1) -> list[Sandbox]:
        """`n` (≤ 16) new sandboxes, each a copy of this one as of now."""
        out = self._t.fork(self.sandbox_id, n)
        return [Sandbox(i["sandbox_id"], self._t, i) for i in out["sandboxes"]]

    def kill(self) -> None:
        self._t.kill(self.sandbox_id)
        self.info = {**self.info, "state": "killed"}

    # ---- work ---------------------------------------------------------------------------------------
    def exec(self, cmd: str | list[str], timeout: float = 60.0, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | str | None = None) -> ExecResult:
        """Run a command (a string goes to /bin/sh -c) and wait. Missing binary: exit_code 127."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        return ExecResult(**self._t.exec(self.sandbox_id, cmd, timeout, env, cwd, stdin))

    def read_file(self, path: str) -> bytes:
        return self._t.read_file(self.sandbox_id, path)

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read_file(path).decode(encoding)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        if isinstance(data, str):
            data = data.encode()
        if len(data) > MAX_FILE_BYTES:
            raise TooLarge(f"file of {len(data)} bytes exceeds the upload limit of {MAX_FILE_BYTES} bytes")
        self._t.write_file(self.sandbox_id, path, bytes(data), mode)

    def list_files(self, path: str = "/") -> list[FileInfo]:
        return [FileInfo(**f) for f in self._t.list_files(self.sandbox_id, path)]

    # ---- context manager: kill on exit ----------------------------------------------------------------
    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.kill()
        except NotFound:
            pass

    def __repr__(self) -> str:
        return f"Sandbox({self.sandbox_id!r}, tier={self.info.get('tier')!r}, state={self.info.get('state')!r})"
