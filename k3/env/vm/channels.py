"""The two control channels of a VM: QMP (QEMU's machine protocol) and the guest exec agent
(k3/env/guest/agent), each a line-oriented unix socket with deadlines."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import socket
import threading
import time

from ..base import SandboxError

log = logging.getLogger("k3.env.vm")

QMP_TIMEOUT_S = 60.0


# ---- QMP ---------------------------------------------------------------------------------------------
class QMPError(SandboxError):
    status = 500


# QEMU's chardev sockets serve one client at a time: a second client waits until the first is gone. Across
# processes the old manager is dead when a new one recovers; within one process (a manager shut down and
# reopened) the old tier object's connections are still open, so a new connection to the same socket closes
# the one this process already holds.
_HOLDERS: dict[str, "_LineSocket"] = {}
_HOLDERS_LOCK = threading.Lock()


class _LineSocket:
    """A unix stream socket read as lines, with deadlines (bytes in, bytes out)."""

    def __init__(self, path: str, timeout: float):
        self.path = path
        with _HOLDERS_LOCK:
            old = _HOLDERS.pop(path, None)
        if old is not None:
            old.close()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(path)
        except BaseException:
            self.sock.close()
            raise
        self.buf = bytearray()
        self._scan = 0
        with _HOLDERS_LOCK:
            _HOLDERS[path] = self

    def close(self) -> None:
        with _HOLDERS_LOCK:
            if _HOLDERS.get(self.path) is self:
                del _HOLDERS[self.path]
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"send to {self.path} timed out")
            self.sock.settimeout(left)
            n = self.sock.send(view)
            view = view[n:]

    def readexact(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"short read on {self.path}")
            self.sock.settimeout(left)
            chunk = self.sock.recv(max(1 << 20, n - len(self.buf)))
            if not chunk:
                raise ConnectionError(f"{self.path} closed")
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        self._scan = 0
        return out

    def readline(self, deadline: float) -> bytes:
        while True:
            i = self.buf.find(b"\n", self._scan)
            if i >= 0:
                line = bytes(self.buf[:i + 1])
                del self.buf[:i + 1]
                self._scan = 0
                return line
            self._scan = len(self.buf)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply on {self.path}")
            self.sock.settimeout(left)
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError(f"{self.path} closed")
            self.buf += chunk


class QMP:
    """A minimal QMP client: capabilities negotiation, `execute`, events kept in `events`."""

    def __init__(self, path: str, timeout: float = 10.0):
        self.conn = _LineSocket(path, timeout)
        self.events: list[dict] = []
        self.lock = threading.Lock()
        deadline = time.monotonic() + timeout
        while True:  # on a reconnect QEMU may flush events queued for the last client ahead of the greeting
            greeting = json.loads(self.conn.readline(deadline))
            if "event" in greeting:
                self.events.append(greeting)
                continue
            if "QMP" not in greeting:
                raise QMPError(f"not a QMP greeting: {greeting}")
            break
        self.execute("qmp_capabilities", timeout=timeout)

    def close(self) -> None:
        self.conn.close()

    def execute(self, cmd: str, args: dict | None = None, timeout: float = QMP_TIMEOUT_S,
                fds: list[int] | None = None):
        """Run a command; `fds` go along as SCM_RIGHTS (for getfd)."""
        msg = {"execute": cmd}
        if args:
            msg["arguments"] = args
        with self.lock:
            deadline = time.monotonic() + timeout
            data = json.dumps(msg).encode() + b"\n"
            if fds:
                self.conn.sock.settimeout(timeout)
                socket.send_fds(self.conn.sock, [data], fds)
            else:
                self.conn.send(data, deadline)
            while True:
                r = json.loads(self.conn.readline(deadline))
                if "event" in r:
                    self.events.append(r)
                    del self.events[:-100]
                    continue
                if "error" in r:
                    raise QMPError(f"QMP {cmd}: {r['error'].get('class')}: {r['error'].get('desc')}")
                if "return" in r:
                    return r["return"]


# ---- agent -------------------------------------------------------------------------------------------
class AgentError(SandboxError):
    status = 500


class Agent:
    """Client of k3/env/guest/agent over the VM's virtio-serial chardev socket."""

    def __init__(self, path: str):
        self.path = path
        self.conn: _LineSocket | None = None
        self.next_id = int(time.time() * 1000) % 1_000_000_000  # distinct from ids a previous host used
        self.lock = threading.Lock()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _connect(self) -> _LineSocket:
        if self.conn is None:
            self.conn = _LineSocket(self.path, 10.0)
        return self.conn

    def request(self, op: str, fields: dict | None = None, payload: bytes = b"", timeout: float = 60.0,
                raw: tuple[str, ...] = (), probe_after: float | None = None) -> dict:
        """Send one request; return its response header. `raw` names the header fields whose payloads
        follow the line (padded to the header's "bs"), read into r["raw"][name]; then the trailer.

        After `probe_after` seconds without an answer, a ping goes out every few seconds: the agent serves
        requests in order, so an answered ping means this request was lost (the agent died and init
        respawned it) and waiting longer is pointless."""
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            hdr = {"id": rid, "op": op, **(fields or {})}
            start = time.monotonic()
            deadline = start + timeout
            probe_at = start + probe_after if probe_after is not None else deadline
            probes: set[int] = set()
            try:
                conn = self._connect()
                conn.send(json.dumps(hdr, separators=(",", ":")).encode() + b"\n" + payload, deadline)
                while True:
                    try:
                        line = conn.readline(min(deadline, probe_at))
                    except TimeoutError:
                        if time.monotonic() >= deadline:
                            raise
                        self.next_id += 1
                        probes.add(self.next_id)
                        conn.send(b'{"id":%d,"op":"ping"}\n' % self.next_id, deadline)
                        probe_at = time.monotonic() + 3.0
                        continue
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue  # noise, e.g. the rest of a payload a previous host stopped reading
                    if not isinstance(r, dict):
                        continue
                    if r.get("id") in probes:
                        raise ConnectionError(f"the guest agent restarted; the {op} request was lost")
                    if r.get("id") == rid and "end" not in r:
                        break
                if r.get("ok") and raw:
                    bs = int(r.get("bs") or 512)
                    r["raw"] = {}
                    for name in raw:
                        n = int(r.get(name) or 0)
                        r["raw"][name] = conn.readexact(-(-n // bs) * bs, deadline)[:n] if n else b""
                    end = json.loads(conn.readline(deadline))
                    if end != {"id": rid, "end": True}:
                        raise ConnectionError(f"agent stream out of step after {op} (got {end!r:.200})")
                return r
            except (OSError, TimeoutError, ConnectionError, ValueError) as e:
                self.close()  # unknown stream position: the next request starts clean (ids resync it)
                raise AgentError(f"guest agent {op} failed: {type(e).__name__}: {e}") from e

    def wait_ready(self, timeout: float, alive=lambda: True, console: Path | None = None) -> float:
        """Ping until the agent answers; returns the guest uptime it reported."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if not alive():
                tail = ""
                with contextlib.suppress(OSError):
                    tail = console.read_text(errors="replace")[-1500:] if console else ""
                raise SandboxError(f"QEMU exited while waiting for the guest agent ({last}); console: {tail}")
            try:
                r = self.request("ping", timeout=min(1.0, max(0.05, deadline - time.monotonic())))
                return float(r.get("uptime") or 0)
            except AgentError as e:
                last = e
                time.sleep(0.05)
        raise SandboxError(f"guest agent did not answer within {timeout:.0f} s ({last})")


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s or "")


