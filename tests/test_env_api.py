"""Sandbox control plane: SandboxManager, the REST server and the Sandbox client, against an in-test fake tier
(plus, where the host allows it, the same client flow on the real process tier)."""

from __future__ import annotations

import base64
import json
import os
import shlex
import socket
import threading
import time
import warnings
from pathlib import Path

import pytest
import uvicorn

with warnings.catch_warnings():  # starlette ≥ 1.x asks for `httpx2` for its TestClient; httpx still works
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

import k3.env.manager as manager_mod
from k3.env import (AuthError, BadRequest, ExecResult, FileInfo, InvalidState, Limits, NotFound, Sandbox,
                    SandboxError, SandboxManager, State, Tier, TooLarge, Unavailable)
from k3.env.manager import atomic_write_json
from k3.env.server import create_app


# ---- the fake tier -------------------------------------------------------------------------------------
class FakeTier(Tier):
    """Files in a dict per sandbox, mirrored to state_dir so recover() and snapshots survive a restart."""

    name = "fake"
    instances: list[FakeTier] = []

    def __init__(self, state_dir):
        super().__init__(state_dir)
        self.files: dict[str, dict[str, bytes]] = {}
        self.env: dict[str, dict] = {}
        self.paused: set[str] = set()
        self.killed: list[str] = []
        self.checkpoints: list[tuple[str, str, str | None]] = []  # (sid, snap, parent snap)
        self.deleted_snaps: list[str] = []
        self.recovered: list[tuple[str, State]] = []
        self.active = 0
        self.max_active = 0
        self.mu = threading.Lock()
        FakeTier.instances.append(self)

    # persistence of the fake's own data
    def _dump(self, name: str, files: dict[str, bytes]) -> None:
        atomic_write_json(self.state_dir / f"{name}.json", {k: base64.b64encode(v).decode() for k, v in files.items()})

    def _load(self, name: str) -> dict[str, bytes]:
        p = self.state_dir / f"{name}.json"
        if not p.exists():
            raise SandboxError(f"fake: no data for {name}")
        return {k: base64.b64decode(v) for k, v in json.loads(p.read_text()).items()}

    @staticmethod
    def _path(path: str) -> str:
        if not path.startswith("/") or ".." in path.split("/"):
            raise BadRequest(f"path {path!r} escapes the sandbox")
        return "/" + "/".join(p for p in path.split("/") if p)

    def _running(self, sid: str) -> dict[str, bytes]:
        if sid not in self.files:
            raise NotFound(f"fake: no sandbox {sid}")
        assert sid not in self.paused, "the manager let work reach a paused sandbox"
        return self.files[sid]

    def create(self, sid, limits, base=None, snapshot=None, env=None):
        if base == "explode":
            raise SandboxError("fake: base 'explode' explodes")
        files = self._load(snapshot.snapshot_id) if snapshot is not None else {"/etc/hostname": sid.encode()}
        if base:
            files["/etc/base"] = base.encode()
        self.files[sid] = files
        self.env[sid] = dict(env or {})
        self._dump(sid, files)
        return {"fake": True, "memory_mb": limits.memory_mb}

    def kill(self, sid):
        self.files.pop(sid, None)
        self.paused.discard(sid)
        self.killed.append(sid)
        (self.state_dir / f"{sid}.json").unlink(missing_ok=True)

    def pause(self, sid):
        assert sid not in self.paused
        self.paused.add(sid)

    def resume(self, sid):
        assert sid in self.paused
        self.paused.discard(sid)

    def checkpoint(self, sid, snapshot_id, parent):
        self._dump(snapshot_id, self.files[sid])
        self.checkpoints.append((sid, snapshot_id, parent.snapshot_id if parent else None))
        return {"nfiles": len(self.files[sid])}

    def delete_snapshot(self, snap):
        self.deleted_snaps.append(snap.snapshot_id)
        (self.state_dir / f"{snap.snapshot_id}.json").unlink(missing_ok=True)

    def recover(self, sid, meta, state):
        assert meta.get("fake") is True
        self.files[sid] = self._load(sid)
        self.paused.add(sid)
        self.recovered.append((sid, state))

    def exec(self, sid, cmd, timeout=60.0, env=None, cwd=None, stdin=None):
        files = self._running(sid)
        argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
        with self.mu:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            prog, args = argv[0], argv[1:]
            if prog == "echo":
                return ExecResult(" ".join(args) + "\n", "", 0)
            if prog == "cat":
                if not args:
                    return ExecResult((stdin or b"").decode(), "", 0)
                p = self._path(args[0])
                if p not in files:
                    return ExecResult("", f"cat: {args[0]}: No such file or directory\n", 1)
                return ExecResult(files[p].decode(), "", 0)
            if prog == "sleep":
                t = float(args[0])
                if t > timeout:
                    time.sleep(timeout)
                    return ExecResult("", "", 124, timed_out=True, duration_s=timeout)
                time.sleep(t)
                return ExecResult("", "", 0, duration_s=t)
            if prog == "printenv":
                return ExecResult({**self.env[sid], **(env or {})}.get(args[0], "") + "\n", "", 0)
            if prog == "pwd":
                return ExecResult((cwd or "/") + "\n", "", 0)
            return ExecResult("", f"sh: {prog}: not found\n", 127)
        finally:
            with self.mu:
                self.active -= 1

    def read_file(self, sid, path):
        files = self._running(sid)
        p = self._path(path)
        if p not in files:
            raise NotFound(f"no file {path}")
        return files[p]

    def write_file(self, sid, path, data, mode=0o644):
        files = self._running(sid)
        files[self._path(path)] = bytes(data)
        self._dump(sid, files)

    def list_files(self, sid, path):
        files = self._running(sid)
        d = self._path(path).rstrip("/") + "/"
        out, seen = [], set()
        for p, data in sorted(files.items()):
            if not p.startswith(d):
                continue
            head, _, rest = p[len(d):].partition("/")
            if head in seen:
                continue
            seen.add(head)
            out.append(FileInfo(head, d + head, bool(rest), 0 if rest else len(data)))
        return out


class NoHostTier(FakeTier):
    name = "nohost"

    @classmethod
    def available(cls):
        return False, "needs a frobnicator (apt-get install frobnicator)"


TIERS = {"fake": FakeTier, "nohost": NoHostTier}


def make_manager(path: Path, **kw) -> SandboxManager:
    return SandboxManager(path, tiers=TIERS, default_tier="fake", ttl_poll_s=0.02, **kw)


def crash(m: SandboxManager) -> None:
    """Simulate the manager process dying: no shutdown, just drop its TTL thread and state-dir lock."""
    m._stop.set()
    m._reaper.join(2)
    m._lockfile.close()
    m._closed = True


def wait_for(pred, timeout=5.0, step=0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


@pytest.fixture
def mgr(tmp_path):
    m = make_manager(tmp_path / "state")
    yield m
    m.shutdown()


def fake(m: SandboxManager) -> FakeTier:
    return m._tier("fake")


# ---- manager: state machine, validation, tiers --------------------------------------------------------
class TestManager:
    def test_ids_and_state_machine(self, mgr):
        info = mgr.create(tier="fake", env={"A": "1"})
        sid = info["sandbox_id"]
        assert sid.startswith("sbx-") and len(sid) == 16 and info["state"] == "running" and info["tier"] == "fake"
        assert "env" not in info
        assert mgr.exec(sid, "printenv A").stdout == "1\n"
        assert mgr.pause(sid)["state"] == "paused"
        for op in (lambda: mgr.pause(sid), lambda: mgr.exec(sid, "echo x"),
                   lambda: mgr.write_file(sid, "/a", b"x"), lambda: mgr.read_file(sid, "/etc/hostname"),
                   lambda: mgr.list_files(sid, "/")):
            with pytest.raises(InvalidState):
                op()
        assert mgr.get(sid)["state"] == "paused"
        assert mgr.resume(sid)["state"] == "running"
        with pytest.raises(InvalidState):
            mgr.resume(sid)
        mgr.kill(sid)
        assert sid in fake(mgr).killed
        for op in (lambda: mgr.get(sid), lambda: mgr.kill(sid), lambda: mgr.exec(sid, "echo"),
                   lambda: mgr.pause(sid), lambda: mgr.checkpoint(sid)):
            with pytest.raises(NotFound):
                op()
        assert mgr.list() == []
        assert not list((mgr.state_dir / "sandboxes").glob("*.json"))

    def test_kill_paused_and_exec_semantics(self, mgr):
        sid = mgr.create()["sandbox_id"]  # default tier = fake
        r = mgr.exec(sid, ["no-such-binary", "--x"])
        assert r.exit_code == 127 and "not found" in r.stderr
        r = mgr.exec(sid, "cat", stdin=b"in")
        assert r.stdout == "in"
        assert mgr.exec(sid, "pwd", cwd="/tmp").stdout == "/tmp\n"
        mgr.pause(sid)
        mgr.kill(sid)
        assert mgr.list() == []

    def test_unknown_and_unavailable_tiers(self, mgr):
        with pytest.raises(BadRequest) as e:
            mgr.create(tier="qemu-xyz")
        assert "fake" in str(e.value) and "nohost" in str(e.value) and "process" in str(e.value)
        with pytest.raises(Unavailable) as e:
            mgr.create(tier="nohost")
        assert e.value.status == 503 and "frobnicator" in str(e.value)
        st = mgr.tier_status()
        assert st["fake"]["available"] and not st["nohost"]["available"]
        assert mgr.list() == []

    @pytest.mark.parametrize("kw", [dict(timeout_s=-1), dict(timeout_s="5"), dict(auto_pause="yes"),
                                    dict(limits={"memory_mb": 0}), dict(limits={"gpus": 1}),
                                    dict(limits={"network": "no"}), dict(env={"A": 1}), dict(env={"A=B": "1"}),
                                    dict(base="b", snapshot_id="snap-x"), dict(metadata=[1])])
    def test_create_validation_changes_nothing(self, mgr, kw):
        with pytest.raises(BadRequest):
            mgr.create(**kw)
        assert mgr.list() == [] and fake(mgr).files == {}

    def test_create_unknown_snapshot(self, mgr):
        with pytest.raises(NotFound):
            mgr.create(snapshot_id="snap-000000000000")

    def test_tier_create_failure_leaves_nothing(self, mgr):
        with pytest.raises(SandboxError, match="explodes"):
            mgr.create(base="explode")
        assert mgr.list() == []
        assert not list((mgr.state_dir / "sandboxes").iterdir())
        assert len(fake(mgr).killed) == 1  # the tier was asked to clean up

    def test_limits_and_upload_cap(self, mgr):
        info = mgr.create(limits={"memory_mb": 256, "file_mb": 1, "network": True})
        sid = info["sandbox_id"]
        assert info["limits"] == {"memory_mb": 256, "cpus": 1.0, "pids": 256, "file_mb": 1, "network": True}
        mgr.write_file(sid, "/ok", b"x" * (1 << 20))
        with pytest.raises(TooLarge):
            mgr.write_file(sid, "/big", b"x" * ((1 << 20) + 1))
        with pytest.raises(BadRequest):
            mgr.write_file(sid, "/../etc/passwd", b"x")  # the tier refuses traversal
        with pytest.raises(BadRequest):
            mgr.write_file(sid, "/m", b"x", mode=0o77777)
        assert mgr.read_file(sid, "/ok") == b"x" * (1 << 20)

    def test_exec_validation(self, mgr):
        sid = mgr.create()["sandbox_id"]
        for kw in (dict(cmd=""), dict(cmd=[]), dict(cmd=[1]), dict(cmd="echo", timeout=0),
                   dict(cmd="echo", env={"A": 2}), dict(cmd="echo", stdin="text")):
            with pytest.raises(BadRequest):
                mgr.exec(sid, **kw)

    def test_per_sandbox_lock_serialises(self, mgr):
        a = mgr.create()["sandbox_id"]
        b = mgr.create()["sandbox_id"]
        t = fake(mgr)
        ths = [threading.Thread(target=mgr.exec, args=(a, "sleep 0.2")) for _ in range(3)]
        [th.start() for th in ths]
        [th.join() for th in ths]
        assert t.max_active == 1
        t.max_active = 0
        ths = [threading.Thread(target=mgr.exec, args=(s, "sleep 0.3")) for s in (a, b)]
        [th.start() for th in ths]
        [th.join() for th in ths]
        assert t.max_active == 2  # different sandboxes run concurrently

    def test_second_manager_on_same_dir_refused(self, mgr):
        with pytest.raises(Unavailable, match="in use"):
            SandboxManager(mgr.state_dir, tiers=TIERS)


# ---- TTL ----------------------------------------------------------------------------------------------
class TestTTL:
    def test_auto_pause(self, mgr):
        sid = mgr.create(timeout_s=0.3)["sandbox_id"]
        info = mgr.get(sid)
        assert info["timeout_s"] == 0.3 and info["expires_at"] is not None
        assert mgr.get(sid)["state"] == "running"
        assert wait_for(lambda: mgr.get(sid)["state"] == "paused", 3)
        assert sid in fake(mgr).paused
        assert json.loads((mgr.state_dir / "sandboxes" / f"{sid}.json").read_text())["state"] == "paused"
        # resume restarts the clock; a paused sandbox never expires further
        mgr.resume(sid)
        assert mgr.get(sid)["state"] == "running"
        assert wait_for(lambda: mgr.get(sid)["state"] == "paused", 3)

    def test_kill_on_expiry(self, mgr):
        sid = mgr.create(timeout_s=0.3, auto_pause=False)["sandbox_id"]
        assert wait_for(lambda: mgr.list() == [], 3)
        assert sid in fake(mgr).killed

    def test_set_timeout(self, mgr):
        sid = mgr.create()["sandbox_id"]
        time.sleep(0.2)
        assert mgr.get(sid)["state"] == "running" and mgr.get(sid)["expires_at"] is None
        mgr.set_timeout(sid, 0.2)
        assert wait_for(lambda: mgr.get(sid)["state"] == "paused", 3)
        mgr.set_timeout(sid, None)
        mgr.resume(sid)
        time.sleep(0.4)
        assert mgr.get(sid)["state"] == "running"
        with pytest.raises(BadRequest):
            mgr.set_timeout(sid, 0)

    def test_busy_sandbox_expires_after_its_request(self, mgr):
        sid = mgr.create(timeout_s=0.1)["sandbox_id"]
        r = mgr.exec(sid, "sleep 0.4")  # expiry falls inside the exec: it must complete
        assert r.exit_code == 0
        assert wait_for(lambda: mgr.get(sid)["state"] == "paused", 3)


# ---- snapshots and fork ------------------------------------------------------------------------------
class TestSnapshots:
    def test_parent_chain(self, mgr):
        t = fake(mgr)
        a = mgr.create()["sandbox_id"]
        mgr.write_file(a, "/f", b"1")
        s1 = mgr.checkpoint(a)
        assert s1["snapshot_id"].startswith("snap-") and s1["parent"] is None and s1["sandbox_id"] == a
        mgr.write_file(a, "/f", b"2")
        s2 = mgr.checkpoint(a)
        assert s2["parent"] == s1["snapshot_id"]  # a second checkpoint layers on the first
        b = mgr.restore(s1["snapshot_id"])
        assert b["snapshot_id"] == s1["snapshot_id"] and b["tier"] == "fake"
        assert mgr.read_file(b["sandbox_id"], "/f") == b"1"
        s3 = mgr.checkpoint(b["sandbox_id"])
        assert s3["parent"] == s1["snapshot_id"]  # restored from S → checkpoint's parent is S
        assert t.checkpoints[-1] == (b["sandbox_id"], s3["snapshot_id"], s1["snapshot_id"])  # the tier saw it
        assert [s["snapshot_id"] for s in mgr.list_snapshots()] == [s["snapshot_id"] for s in (s1, s2, s3)]
        assert mgr.get_snapshot(s2["snapshot_id"]) == s2
        assert mgr.snapshot_info(s2["snapshot_id"]).meta == {"nfiles": 2}

    def test_checkpoint_paused_stays_paused(self, mgr):
        a = mgr.create()["sandbox_id"]
        mgr.pause(a)
        mgr.checkpoint(a)
        assert mgr.get(a)["state"] == "paused"

    def test_delete_with_dependants_is_deferred(self, mgr):
        t = fake(mgr)
        a = mgr.create()["sandbox_id"]
        s1 = mgr.checkpoint(a)["snapshot_id"]
        s2 = mgr.checkpoint(a)["snapshot_id"]  # parent s1; a now builds on s2
        mgr.delete_snapshot(s1)  # s2 builds on it: hidden, not freed
        with pytest.raises(NotFound):
            mgr.get_snapshot(s1)
        with pytest.raises(NotFound):
            mgr.restore(s1)
        assert t.deleted_snaps == []
        mgr.delete_snapshot(s2)  # a builds on s2
        assert t.deleted_snaps == [] and mgr.list_snapshots() == []
        mgr.kill(a)  # last dependant gone → s2 then s1 freed
        assert t.deleted_snaps == [s2, s1]
        assert not list((mgr.state_dir / "snapshots").glob("*.json"))
        with pytest.raises(NotFound):
            mgr.delete_snapshot(s1)

    def test_delete_leaf_snapshot(self, mgr):
        a = mgr.create()["sandbox_id"]
        s1 = mgr.checkpoint(a)["snapshot_id"]
        b = mgr.restore(s1)["sandbox_id"]
        mgr.kill(b)
        mgr.checkpoint(a)  # a moves on to s2 (parent s1) ...
        mgr.kill(a)
        s2 = mgr.list_snapshots()[-1]["snapshot_id"]
        mgr.delete_snapshot(s2)  # ... leaf: freed at once
        assert fake(mgr).deleted_snaps == [s2]
        mgr.delete_snapshot(s1)
        assert fake(mgr).deleted_snaps == [s2, s1]

    def test_fork(self, mgr):
        a = mgr.create(timeout_s=100, limits={"memory_mb": 300}, env={"K": "v"}, metadata={"who": "me"})["sandbox_id"]
        mgr.write_file(a, "/shared", b"base")
        out = mgr.fork(a, 3)
        kids = out["sandboxes"]
        assert len(kids) == 3 and len({k["sandbox_id"] for k in kids}) == 3
        assert mgr.get_snapshot(out["snapshot_id"])["sandbox_id"] == a
        for i, k in enumerate(kids):
            assert k["state"] == "running" and k["snapshot_id"] == out["snapshot_id"]
            assert k["limits"]["memory_mb"] == 300 and k["timeout_s"] == 100
            assert k["metadata"] == {"who": "me", "forked_from": a}
            assert mgr.exec(k["sandbox_id"], "printenv K").stdout == "v\n"
            mgr.write_file(k["sandbox_id"], "/shared", f"kid{i}".encode())
        for i, k in enumerate(kids):  # independent
            assert mgr.read_file(k["sandbox_id"], "/shared") == f"kid{i}".encode()
        assert mgr.read_file(a, "/shared") == b"base"
        assert mgr.get(a)["state"] == "running"
        assert len(mgr.list()) == 4
        # the source's next checkpoint builds on the fork snapshot
        assert mgr.checkpoint(a)["parent"] == out["snapshot_id"]

    @pytest.mark.parametrize("n", [0, -1, 17, 2.0, True, "3"])
    def test_fork_count_bounds(self, mgr, n):
        a = mgr.create()["sandbox_id"]
        with pytest.raises(BadRequest):
            mgr.fork(a, n)
        assert len(mgr.list()) == 1 and mgr.list_snapshots() == []

    def test_fork_max(self, mgr):
        a = mgr.create()["sandbox_id"]
        assert len(mgr.fork(a, 16)["sandboxes"]) == 16

    def test_fork_failure_rolls_back_children(self, mgr, monkeypatch):
        a = mgr.create()["sandbox_id"]
        t = fake(mgr)
        real, n = t.create, [0]

        def flaky(sid, limits, base=None, snapshot=None, env=None):
            n[0] += 1
            if n[0] == 2:
                raise SandboxError("fake: no room")
            return real(sid, limits, base=base, snapshot=snapshot, env=env)

        monkeypatch.setattr(t, "create", flaky)
        with pytest.raises(SandboxError, match="no room"):
            mgr.fork(a, 3)
        assert [s["sandbox_id"] for s in mgr.list()] == [a]


# ---- persistence -------------------------------------------------------------------------------------
class TestPersistence:
    def test_restart_keeps_paused_sandboxes_and_snapshots(self, tmp_path):
        d = tmp_path / "state"
        m1 = make_manager(d)
        a = m1.create(timeout_s=50, limits={"pids": 7})["sandbox_id"]
        m1.write_file(a, "/data", b"kept")
        m1.pause(a)
        b = m1.create()["sandbox_id"]
        m1.write_file(b, "/x", b"bx")
        s1 = m1.checkpoint(b)["snapshot_id"]
        m1.write_file(b, "/x", b"bx2")
        s2 = m1.checkpoint(b)["snapshot_id"]
        m1.shutdown()  # b is running → paused, nothing killed
        assert fake(m1).killed == []
        with pytest.raises(Unavailable):
            m1.list()

        m2 = make_manager(d)
        try:
            t2 = fake(m2)
            infos = {i["sandbox_id"]: i for i in m2.list()}
            assert set(infos) == {a, b}
            assert all(i["state"] == "paused" and i["error"] is None for i in infos.values())
            assert infos[a]["limits"]["pids"] == 7 and infos[a]["timeout_s"] == 50
            assert sorted(t2.recovered) == sorted([(a, State.PAUSED), (b, State.PAUSED)])
            assert [s["snapshot_id"] for s in m2.list_snapshots()] == [s1, s2]
            assert m2.get_snapshot(s2)["parent"] == s1
            m2.resume(a)
            assert m2.read_file(a, "/data") == b"kept"
            assert m2.get(a)["expires_at"] is not None
            c = m2.restore(s1)["sandbox_id"]
            assert m2.read_file(c, "/x") == b"bx"
            m2.resume(b)
            assert m2.checkpoint(b)["parent"] == s2  # the chain continues across the restart
        finally:
            m2.shutdown()

    def test_crash_recovers_running_as_paused_and_drops_half_created(self, tmp_path):
        d = tmp_path / "state"
        m1 = make_manager(d)
        a = m1.create()["sandbox_id"]
        m1.write_file(a, "/f", b"before crash")
        crash(m1)
        # a half-created sandbox and a stray temp file, as a crash mid-create / mid-write would leave them
        atomic_write_json(d / "sandboxes" / "sbx-deadbeef0000.json",
                          {"sandbox_id": "sbx-deadbeef0000", "tier": "fake", "state": "creating",
                           "limits": {}, "created_at": 0.0})
        (d / "sandboxes" / ".sbx-aaaa.json.123.tmp").write_text('{"half')
        m2 = make_manager(d)
        try:
            assert [(i["sandbox_id"], i["state"]) for i in m2.list()] == [(a, "paused")]
            assert "sbx-deadbeef0000" in fake(m2).killed
            assert sorted(p.name for p in (d / "sandboxes").iterdir()) == [f"{a}.json"]
            m2.resume(a)
            assert m2.read_file(a, "/f") == b"before crash"
        finally:
            m2.shutdown()

    def test_unrecoverable_sandbox_kept_with_error(self, tmp_path):
        d = tmp_path / "state"
        m1 = make_manager(d)
        a = m1.create()["sandbox_id"]
        m1.shutdown()
        (d / "fake" / f"{a}.json").unlink()  # the tier's data is gone
        m2 = make_manager(d)
        try:
            info = m2.get(a)
            assert info["state"] == "paused" and "recovery failed" in info["error"]
            with pytest.raises(Unavailable):
                m2.resume(a)
            m2.kill(a)
            assert m2.list() == []
        finally:
            m2.shutdown()

    def test_unknown_tier_after_restart(self, tmp_path):
        d = tmp_path / "state"
        m1 = make_manager(d)
        a = m1.create()["sandbox_id"]
        m1.shutdown()
        m2 = SandboxManager(d, tiers={"other": FakeTier}, default_tier="other")
        try:
            assert m2.get(a)["error"] and m2.get(a)["state"] == "paused"
            with pytest.raises(BadRequest):
                m2.kill(a)  # can't reach its tier: kept, not silently dropped
        finally:
            m2.shutdown()
        m3 = make_manager(d)  # with the tier back, it recovers
        try:
            assert m3.get(a)["error"] is None
        finally:
            m3.shutdown()

    def test_state_files_always_valid_json(self, mgr):
        a = mgr.create()["sandbox_id"]
        mgr.pause(a)
        mgr.resume(a)
        mgr.checkpoint(a)
        for p in (mgr.state_dir / "sandboxes").iterdir():
            assert not p.name.endswith(".tmp")
            json.loads(p.read_text())
        rec = json.loads((mgr.state_dir / "sandboxes" / f"{a}.json").read_text())
        assert rec["state"] == "running" and rec["meta"] == {"fake": True, "memory_mb": 512}

    def test_atomic_write_failure_keeps_old_file(self, tmp_path, monkeypatch):
        p = tmp_path / "x.json"
        atomic_write_json(p, {"v": 1})

        def boom(fd):
            raise OSError("disk on fire")

        monkeypatch.setattr(manager_mod.os, "fsync", boom)
        with pytest.raises(OSError):
            atomic_write_json(p, {"v": 2})
        monkeypatch.undo()
        assert json.loads(p.read_text()) == {"v": 1}
        assert [q.name for q in tmp_path.iterdir()] == ["x.json"]  # no temp left behind

    def test_failed_persist_of_create_is_rolled_back(self, mgr, monkeypatch):
        calls = [0]
        real = manager_mod.os.replace

        def flaky(a, b):
            calls[0] += 1
            if calls[0] == 2:  # the "running" record after tier.create
                raise OSError("disk full")
            return real(a, b)

        monkeypatch.setattr(manager_mod.os, "replace", flaky)
        with pytest.raises(OSError):
            mgr.create()
        monkeypatch.undo()
        assert mgr.list() == [] and fake(mgr).files == {}
        assert not list((mgr.state_dir / "sandboxes").iterdir())


# ---- REST server (TestClient) -------------------------------------------------------------------------
@pytest.fixture
def api(mgr):
    with TestClient(create_app(mgr)) as c:
        yield c


def _new(api, **body) -> str:
    r = api.post("/sandboxes", json={"tier": "fake", **body})
    assert r.status_code == 201, r.text
    return r.json()["sandbox_id"]


class TestREST:
    def test_happy_path(self, api):
        assert api.get("/health").json() == {"status": "ok"}
        assert api.get("/tiers").json()["fake"]["available"] is True
        r = api.post("/sandboxes", json={"tier": "fake", "timeout_s": 100, "auto_pause": True,
                                         "limits": {"memory_mb": 128, "cpus": 0.5, "pids": 64, "network": False},
                                         "env": {"X": "y"}})
        assert r.status_code == 201
        info = r.json()
        sid = info["sandbox_id"]
        assert info["state"] == "running" and info["limits"]["cpus"] == 0.5
        assert api.post("/sandboxes").status_code == 201  # no body: all defaults (fake is the default tier)
        assert len(api.get("/sandboxes").json()) == 2
        assert api.get(f"/sandboxes/{sid}").json()["sandbox_id"] == sid
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "printenv X"})
        assert r.json() == {"stdout": "y\n", "stderr": "", "exit_code": 0, "timed_out": False, "duration_s": 0.0}
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": ["cat"], "stdin_b64": base64.b64encode(b"abc").decode(),
                                                      "timeout": 5, "cwd": "/", "env": {"A": "b"}})
        assert r.json()["stdout"] == "abc"
        assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": "sleep 5", "timeout": 0.05}).json()["timed_out"]
        r = api.put(f"/sandboxes/{sid}/files", params={"path": "/w/a.bin"}, content=b"\x00\xffdata")
        assert r.status_code == 204
        r = api.get(f"/sandboxes/{sid}/files", params={"path": "/w/a.bin"})
        assert r.content == b"\x00\xffdata" and r.headers["content-type"] == "application/octet-stream"
        assert api.get(f"/sandboxes/{sid}/files/list", params={"path": "/w"}).json() == [
            {"name": "a.bin", "path": "/w/a.bin", "is_dir": False, "size": 6}]
        assert api.post(f"/sandboxes/{sid}/pause").json()["state"] == "paused"
        assert api.post(f"/sandboxes/{sid}/resume").json()["state"] == "running"
        assert api.post(f"/sandboxes/{sid}/timeout", json={"timeout_s": 30}).json()["timeout_s"] == 30
        r = api.post(f"/sandboxes/{sid}/snapshots")
        assert r.status_code == 201
        snap = r.json()["snapshot_id"]
        assert api.get("/snapshots").json()[0]["snapshot_id"] == snap
        assert api.get(f"/snapshots/{snap}").json()["sandbox_id"] == sid
        r = api.post(f"/sandboxes/{sid}/fork", json={"count": 2})
        assert r.status_code == 201 and len(r.json()["sandboxes"]) == 2
        assert api.post(f"/sandboxes/{sid}/fork").json()["sandboxes"][0]["state"] == "running"  # count 1
        r = api.post("/sandboxes", json={"snapshot_id": snap})
        assert r.status_code == 201 and r.json()["snapshot_id"] == snap
        rid = r.json()["sandbox_id"]
        assert api.get(f"/sandboxes/{rid}/files", params={"path": "/w/a.bin"}).content == b"\x00\xffdata"
        assert api.delete(f"/sandboxes/{rid}").status_code == 204
        assert api.get(f"/sandboxes/{rid}").status_code == 404
        assert api.delete(f"/snapshots/{snap}").status_code == 204
        assert api.get(f"/snapshots/{snap}").status_code == 404

    def test_unknown_ids_404(self, api):
        bad = "sbx-000000000000"
        calls = [("get", f"/sandboxes/{bad}", {}), ("delete", f"/sandboxes/{bad}", {}),
                 ("post", f"/sandboxes/{bad}/pause", {}), ("post", f"/sandboxes/{bad}/resume", {}),
                 ("post", f"/sandboxes/{bad}/snapshots", {}),
                 ("post", f"/sandboxes/{bad}/fork", {"json": {"count": 1}}),
                 ("post", f"/sandboxes/{bad}/timeout", {"json": {"timeout_s": 1}}),
                 ("post", f"/sandboxes/{bad}/exec", {"json": {"cmd": "echo"}}),
                 ("get", f"/sandboxes/{bad}/files", {"params": {"path": "/a"}}),
                 ("put", f"/sandboxes/{bad}/files", {"params": {"path": "/a"}, "content": b"x"}),
                 ("get", f"/sandboxes/{bad}/files/list", {"params": {"path": "/"}}),
                 ("get", "/snapshots/snap-000000000000", {}), ("delete", "/snapshots/snap-000000000000", {}),
                 ("post", "/sandboxes", {"json": {"snapshot_id": "snap-000000000000"}}),
                 ("get", "/no/such/route", {})]
        for method, url, kw in calls:
            r = getattr(api, method)(url, **kw) if method != "delete" else api.delete(url)
            assert r.status_code == 404, (method, url, r.text)
            assert r.json()["error"] == "NotFound" and r.json()["detail"], (method, url)
        sid = _new(api)
        r = api.get(f"/sandboxes/{sid}/files", params={"path": "/nope"})
        assert r.status_code == 404

    def test_bad_json_and_schema(self, api):
        r = api.post("/sandboxes", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"] == "BadRequest" and "JSON" in r.json()["detail"]
        for body in ({"tier": "fake", "timeout_s": "soon"}, {"tier": "fake", "bogus": 1}, [1, 2],
                     {"tier": "fake", "limits": {"memory_mb": -5}}, {"tier": "fake", "limits": {"gpus": 1}},
                     {"tier": "fake", "env": {"A": 1}}, {"tier": 5}):
            r = api.post("/sandboxes", json=body)
            assert r.status_code == 422, (body, r.text)
            j = r.json()
            assert j["error"] == "ValidationError" and isinstance(j["detail"], str) and j["errors"]
        for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
            r = api.post("/sandboxes", content=b'{"tier": "fake"}', headers=headers)  # no CORS-free JSON
            assert r.status_code == 415 and "application/json" in r.json()["detail"], headers
        assert api.get("/sandboxes").json() == []  # nothing was created
        sid = _new(api)
        for body in ({}, {"cmd": 5}, {"cmd": "echo", "timeout": -1}, {"cmd": "echo", "extra": 1}):
            assert api.post(f"/sandboxes/{sid}/exec", json=body).status_code == 422, body
        r = api.post(f"/sandboxes/{sid}/exec", content=b"[", headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "cat", "stdin_b64": "!!!"})
        assert r.status_code == 400 and "base64" in r.json()["detail"]
        assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": ""}).status_code == 400
        assert api.post(f"/sandboxes/{sid}/fork", json={"count": "x"}).status_code == 422
        assert api.post(f"/sandboxes/{sid}/timeout", json={"timeout_s": 0}).status_code == 422
        assert api.post(f"/sandboxes/{sid}/timeout", json={}).status_code == 422
        assert api.get(f"/sandboxes/{sid}/files").status_code == 422  # path is required
        assert api.put(f"/sandboxes/{sid}/files", params={"path": "/a", "mode": "9z"}, content=b"").status_code == 400
        assert api.post("/sandboxes", json={"tier": "qemu-xyz"}).status_code == 400
        r = api.post("/sandboxes", json={"tier": "nohost"})
        assert r.status_code == 503 and "frobnicator" in r.json()["detail"]
        assert len(api.get("/sandboxes").json()) == 1

    def test_state_errors_409_and_fork_bounds(self, api):
        sid = _new(api)
        assert api.post(f"/sandboxes/{sid}/resume").status_code == 409
        api.post(f"/sandboxes/{sid}/pause")
        r = api.post(f"/sandboxes/{sid}/pause")
        assert r.status_code == 409 and r.json()["error"] == "InvalidState"
        assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": "echo"}).status_code == 409
        assert api.put(f"/sandboxes/{sid}/files", params={"path": "/a"}, content=b"x").status_code == 409
        api.post(f"/sandboxes/{sid}/resume")
        for n in (0, 17):
            r = api.post(f"/sandboxes/{sid}/fork", json={"count": n})
            assert r.status_code == 400 and "1..16" in r.json()["detail"]
        assert len(api.get("/sandboxes").json()) == 1 and api.get("/snapshots").json() == []

    def test_path_traversal_and_missing_binary(self, api):
        sid = _new(api)
        for method, kw in (("get", {}), ("put", {"content": b"x"})):
            r = getattr(api, method)(f"/sandboxes/{sid}/files", params={"path": "/a/../../etc/passwd"}, **kw)
            assert r.status_code == 400 and r.json()["error"] == "BadRequest", r.text
        assert api.get(f"/sandboxes/{sid}/files/list", params={"path": "/.."}).status_code == 400
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "definitely-not-a-binary"})
        assert r.status_code == 200 and r.json()["exit_code"] == 127

    def test_oversized_upload_413(self, api, monkeypatch):
        sid = _new(api, limits={"file_mb": 1})
        big = b"x" * ((1 << 20) + 1)
        r = api.put(f"/sandboxes/{sid}/files", params={"path": "/big"}, content=big)  # Content-Length check
        assert r.status_code == 413 and r.json()["error"] == "TooLarge"

        def chunks():  # no Content-Length: the streamed size is checked
            for _ in range(5):
                yield b"y" * (300 * 1024)

        r = api.put(f"/sandboxes/{sid}/files", params={"path": "/big"}, content=chunks())
        assert r.status_code == 413
        assert api.get(f"/sandboxes/{sid}/files", params={"path": "/big"}).status_code == 404  # nothing written
        monkeypatch.setattr(manager_mod, "MAX_FILE_BYTES", 1000)  # the global cap
        sid2 = _new(api)
        assert api.put(f"/sandboxes/{sid2}/files", params={"path": "/f"}, content=b"z" * 1001).status_code == 413
        assert api.put(f"/sandboxes/{sid2}/files", params={"path": "/f"}, content=b"z" * 1000).status_code == 204

    def test_auth(self, mgr):
        with TestClient(create_app(mgr, api_key="s3cret")) as c:
            assert c.get("/health").status_code == 200
            for headers in ({}, {"X-API-Key": "wrong"}, {"X-API-Key": ""}):
                for method, url in (("get", "/sandboxes"), ("post", "/sandboxes"), ("get", "/snapshots"),
                                    ("get", "/tiers"), ("get", "/sandboxes/sbx-000000000000")):
                    r = c.request(method, url, headers=headers)
                    assert r.status_code == 401 and r.json()["error"] == "Unauthorized", (headers, url)
            assert mgr.list() == []
            ok = {"X-API-Key": "s3cret"}
            assert c.post("/sandboxes", json={"tier": "fake"}, headers=ok).status_code == 201
            assert len(c.get("/sandboxes", headers=ok).json()) == 1


def test_app_lifespan_pauses_on_shutdown(tmp_path):
    m = make_manager(tmp_path / "state")
    with TestClient(create_app(m, shutdown_manager=True)) as c:
        sid = c.post("/sandboxes", json={}).json()["sandbox_id"]
    rec = json.loads((tmp_path / "state" / "sandboxes" / f"{sid}.json").read_text())
    assert rec["state"] == "paused" and fake(m).killed == []
    m2 = make_manager(tmp_path / "state")  # the state dir was released
    try:
        assert m2.get(sid)["state"] == "paused"
    finally:
        m2.shutdown()


# ---- a real uvicorn server + the remote client ---------------------------------------------------------
@pytest.fixture
def live(tmp_path):
    m = make_manager(tmp_path / "srv")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(m, api_key="k3y"), log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    assert wait_for(lambda: server.started, 10)
    try:
        yield f"http://127.0.0.1:{port}", m
    finally:
        server.should_exit = True
        th.join(10)
        sock.close()
        m.shutdown()


class TestRemoteClient:
    def test_flow(self, live, monkeypatch):
        url, m = live
        kw = dict(url=url, api_key="k3y")
        with Sandbox.create(tier="fake", env={"E": "1"}, limits=Limits(memory_mb=64), **kw) as sb:
            assert sb.sandbox_id.startswith("sbx-") and sb.tier == "fake" and sb.state == "running"
            r = sb.exec("echo hello world")
            assert (r.stdout, r.stderr, r.exit_code) == ("hello world\n", "", 0)
            assert sb.exec(["nope"]).exit_code == 127
            assert sb.exec("cat", stdin="piped").stdout == "piped"
            sb.write_file("/d/f.txt", "text")
            sb.write_file("/d/g.bin", b"\x00\x01")
            assert sb.read_file("/d/f.txt") == b"text" and sb.read_text("/d/f.txt") == "text"
            assert [(f.name, f.size) for f in sb.list_files("/d")] == [("f.txt", 4), ("g.bin", 2)]
            with pytest.raises(NotFound):
                sb.read_file("/d/missing")
            with pytest.raises(BadRequest):
                sb.read_file("/d/../../x")
            sb.pause()
            assert sb.info["state"] == "paused" and sb.state == "paused"
            with pytest.raises(InvalidState) as e:
                sb.exec("echo")
            assert e.value.status == 409
            with pytest.raises(InvalidState):
                sb.pause()
            sb.resume()
            snap = sb.checkpoint()
            assert snap.startswith("snap-")
            sb.write_file("/d/f.txt", "changed")
            kids = sb.fork(2)
            assert len(kids) == 2
            kids[0].write_file("/d/f.txt", "kid0")
            assert kids[1].read_text("/d/f.txt") == "changed" and sb.read_text("/d/f.txt") == "changed"
            with pytest.raises(BadRequest):
                sb.fork(17)
            r2 = Sandbox.restore(snap, **kw)
            assert r2.read_text("/d/f.txt") == "text" and r2.info["snapshot_id"] == snap
            assert {s.sandbox_id for s in Sandbox.list(**kw)} == {sb.sandbox_id, r2.sandbox_id,
                                                                   *(k.sandbox_id for k in kids)}
            assert snap in {s["snapshot_id"] for s in Sandbox.snapshots(**kw)}
            same = Sandbox.connect(sb.sandbox_id, **kw)
            assert same.exec("printenv E").stdout == "1\n"
            sb.set_timeout(60)
            assert sb.info["timeout_s"] == 60
            for k in kids:
                k.kill()
            r2.kill()
            with pytest.raises(NotFound):
                r2.exec("echo")
        assert m.list() == []  # the context manager killed it
        with pytest.raises(NotFound):
            Sandbox.connect(sb.sandbox_id, **kw)

    def test_errors_auth_env_and_413(self, live, monkeypatch):
        url, m = live
        with pytest.raises(AuthError) as e:
            Sandbox.create(tier="fake", url=url)
        assert e.value.status == 401
        with pytest.raises(AuthError):
            Sandbox.list(url=url, api_key="nope")
        with pytest.raises(BadRequest, match="valid tiers"):
            Sandbox.create(tier="qemu-xyz", url=url, api_key="k3y")
        with pytest.raises(Unavailable, match="frobnicator"):
            Sandbox.create(tier="nohost", url=url, api_key="k3y")
        monkeypatch.setenv("K3_SANDBOX_URL", url)
        monkeypatch.setenv("K3_SANDBOX_API_KEY", "k3y")
        sb = Sandbox.create(tier="fake", limits={"file_mb": 1})
        assert [s.sandbox_id for s in Sandbox.list()] == [sb.sandbox_id]
        with pytest.raises(TooLarge):
            sb.write_file("/big", b"x" * (2 << 20))
        assert sb.exec("echo ok").stdout == "ok\n"  # the server is fine after refusing the upload
        with pytest.raises(TooLarge):  # the client refuses beyond MAX_FILE_BYTES without sending
            sb.write_file("/huge", memoryview(bytearray(manager_mod.MAX_FILE_BYTES + 1)).tobytes())
        sb.kill()
        with pytest.raises(Unavailable, match="unreachable"):
            Sandbox.list(url="http://127.0.0.1:9", api_key="k3y")


# ---- in-process client ---------------------------------------------------------------------------------
class TestLocalClient:
    def test_flow_with_explicit_manager(self, mgr, monkeypatch):
        monkeypatch.delenv("K3_SANDBOX_URL", raising=False)
        sb = Sandbox.create(tier="fake", manager=mgr)
        assert sb.exec("echo a").stdout == "a\n"
        sb.write_file("/x", b"1")
        snap = sb.checkpoint()
        kids = sb.fork(3)
        assert len(kids) == 3 and all(k.read_file("/x") == b"1" for k in kids)
        sb.pause()
        with pytest.raises(InvalidState):
            sb.write_file("/x", b"2")
        sb.resume()
        r = Sandbox.restore(snap, manager=mgr)
        assert r.tier == "fake" and r.read_file("/x") == b"1"
        assert len(Sandbox.list(manager=mgr)) == 5
        with Sandbox.connect(sb.sandbox_id, manager=mgr) as same:
            assert same.exec("echo b").stdout == "b\n"
        with pytest.raises(NotFound):
            sb.exec("echo")

    def test_default_manager_from_env(self, tmp_path, monkeypatch):
        import k3.env.manager as mm
        monkeypatch.delenv("K3_SANDBOX_URL", raising=False)
        monkeypatch.setenv("K3_SANDBOX_DIR", str(tmp_path / "default"))
        monkeypatch.setattr(mm, "DEFAULT_TIERS", {**mm.DEFAULT_TIERS, "fake": FakeTier})
        mm.set_default_manager(None)
        try:
            sb = Sandbox.create(tier="fake")
            assert mm.default_manager().state_dir == tmp_path / "default"
            assert (tmp_path / "default" / "sandboxes" / f"{sb.sandbox_id}.json").exists()
            sb.kill()
        finally:
            mm.default_manager().shutdown()
            mm.set_default_manager(None)


# ---- the CLI parser ----------------------------------------------------------------------------------
def test_cli_parser():
    import argparse

    from k3.env.cli import add_parser
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["sandbox", "serve", "--host", "0.0.0.0", "--port", "9001", "--state-dir", "/tmp/x",
                      "--api-key", "k"])
    assert (a.host, a.port, a.state_dir, a.api_key) == ("0.0.0.0", 9001, "/tmp/x", "k") and callable(a.func)
    a = p.parse_args(["sandbox", "serve"])
    assert (a.host, a.port) == ("127.0.0.1", 8000)


# ---- integration: the same client flow on the real process tier -------------------------------------------
def _process_tier_ok() -> tuple[bool, str]:
    if not (Path(__file__).resolve().parents[1] / "k3" / "env" / "process" / "__init__.py").exists():
        return False, "k3/env/process/ not present"
    if os.geteuid() != 0:
        return False, "needs root"
    try:
        from k3.env.process import ProcessTier
        ok, why = ProcessTier.available()
    except Exception as e:  # noqa: BLE001
        return False, f"process tier not importable: {e}"
    return ok, why


_PROC_OK, _PROC_WHY = _process_tier_ok()


@pytest.mark.skipif(not _PROC_OK, reason=f"process tier unavailable: {_PROC_WHY}")
class TestProcessTierIntegration:
    def test_client_flow(self, tmp_path, monkeypatch):
        monkeypatch.delenv("K3_SANDBOX_URL", raising=False)
        m = SandboxManager(tmp_path / "state")
        try:
            sb = Sandbox.create(tier="process", manager=m)
            r = sb.exec("echo hello; echo err >&2; exit 3")
            assert (r.stdout, r.stderr, r.exit_code) == ("hello\n", "err\n", 3)
            assert sb.exec(["/no/such/binary"]).exit_code == 127
            sb.write_file("/tmp/k3-test.txt", b"v1")
            assert sb.read_file("/tmp/k3-test.txt") == b"v1"
            assert "k3-test.txt" in {f.name for f in sb.list_files("/tmp")}
            sb.pause()
            with pytest.raises(InvalidState):
                sb.exec("true")
            sb.resume()
            assert sb.exec("cat /tmp/k3-test.txt").stdout == "v1"
            snap = sb.checkpoint()
            sb.write_file("/tmp/k3-test.txt", b"v2")
            r2 = Sandbox.restore(snap, manager=m)
            assert r2.read_file("/tmp/k3-test.txt") == b"v1"
            kids = sb.fork(3)
            for i, k in enumerate(kids):
                assert k.exec("cat /tmp/k3-test.txt").stdout == "v2"
                k.write_file("/tmp/k3-test.txt", f"kid{i}".encode())
            assert [k.read_file("/tmp/k3-test.txt") for k in kids] == [b"kid0", b"kid1", b"kid2"]
            assert sb.read_file("/tmp/k3-test.txt") == b"v2"
            for s in (sb, r2, *kids):
                s.kill()
            assert m.list() == []
        finally:
            for s in m.list():
                m.kill(s["sandbox_id"])
            m.shutdown()
