"""The "vm" sandbox tier (k3/env/vm/): QEMU microvm under TCG, memory snapshots, forks, qcow2 disk chains.

Needs scripts/setup_vm.sh (skipped otherwise). One VM is booted for the module and reused; restores are
cheap (~0.5–1 s), boots are not (~4–8 s under TCG on 2 cores).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from k3.env.base import (MAX_FILE_BYTES, BadRequest, InvalidState, Limits, NotFound, SandboxError, SnapshotInfo,
                         State, TooLarge)
from k3.env.vm import VMTier, qcow2_backing

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VMTier.available()[0], reason=f"vm tier: {VMTier.available()[1]}")]

LIM = Limits(memory_mb=256)
# a loop that keeps its count in a shell variable (memory) and reports it every 0.2 s
COUNTER = ("i=0; echo $$ > /root/counter.pid; "
           "while :; do i=$((i+1)); echo $i > /root/counter.tmp; mv /root/counter.tmp /root/counter; sleep 0.2; done")


def qemu_pids(marker: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "qemu-system" in cmd and marker in cmd:
            out.append(int(p.name))
    return out


def snap(tier: VMTier, sid: str, snap_id: str, parent: SnapshotInfo | None = None) -> SnapshotInfo:
    meta = tier.checkpoint(sid, snap_id, parent)
    return SnapshotInfo(snapshot_id=snap_id, sandbox_id=sid, tier="vm",
                        parent=parent.snapshot_id if parent else None, created_at=time.time(), meta=meta)


def counter(tier: VMTier, sid: str) -> int:
    return int(tier.read_file(sid, "/root/counter").decode().strip() or 0)


def wait_counter(tier: VMTier, sid: str, above: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        try:
            c = counter(tier, sid)
        except NotFound:
            c = 0
        if c > above:
            return c
        if time.monotonic() > deadline:
            raise AssertionError(f"counter in {sid} stuck at {c}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vm")


@pytest.fixture(scope="module")
def tier(state_dir):
    t = VMTier(state_dir)
    yield t
    for sid in list(t._vms):
        t.kill(sid)


@pytest.fixture(scope="module")
def vm(tier):
    t0 = time.monotonic()
    tier.create("main", LIM, env={"K3_SANDBOX": "main"})
    print(f"boot: {time.monotonic() - t0:.2f} s")
    return "main"


def test_available_reports_setup_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("K3_VM_DIR", str(tmp_path))
    ok, why = VMTier.available()
    assert not ok and "setup_vm.sh" in why


def test_exec(tier, vm):
    r = tier.exec(vm, "echo hello; echo oops >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("hello\n", "oops\n", 3, False)
    r = tier.exec(vm, ["printf", "%s|", "a b", "$HOME", "'q'"])
    assert r.stdout == "a b|$HOME|'q'|" and r.exit_code == 0
    assert tier.exec(vm, ["no-such-binary", "x"]).exit_code == 127
    assert tier.exec(vm, "no-such-binary").exit_code == 127
    r = tier.exec(vm, "echo $FOO $K3_SANDBOX; pwd", env={"FOO": "bar baz"}, cwd="/tmp")
    assert r.stdout == "bar baz main\n/tmp\n"
    assert tier.exec(vm, "pwd").stdout == "/root\n"
    assert tier.exec(vm, "cat; echo", stdin=b"from stdin").stdout == "from stdin\n"
    blob = bytes(range(256)) * 64
    r = tier.exec(vm, "cat | md5sum", stdin=blob)
    assert r.stdout.split()[0] == hashlib.md5(blob).hexdigest()
    t0 = time.monotonic()
    r = tier.exec(vm, "echo started; sleep 30; echo never", timeout=1.0)
    assert r.timed_out and r.exit_code == 137 and r.stdout == "started\n"
    assert time.monotonic() - t0 < 10
    # the timeout killed the whole command (its process group), not only the shell
    assert "sleep 30" not in tier.exec(vm, "ps").stdout
    with pytest.raises(BadRequest):
        tier.exec(vm, "true", cwd="relative")


def test_files_pause_resume(tier, vm):
    data = bytes(range(256)) * 1000 + b"\n\0end"
    tier.write_file(vm, "/root/dir/sub/data.bin", data, mode=0o600)
    tier.write_file(vm, "/root/dir/a file\nwith newline", b"x")
    tier.pause(vm)
    with pytest.raises(InvalidState):
        tier.exec(vm, "true")
    with pytest.raises(InvalidState):
        tier.read_file(vm, "/root/dir/sub/data.bin")
    tier.resume(vm)
    assert tier.read_file(vm, "/root/dir/sub/data.bin") == data
    assert tier.exec(vm, "stat -c %a /root/dir/sub/data.bin").stdout == "600\n"
    entries = {f.name: f for f in tier.list_files(vm, "/root/dir")}
    assert set(entries) == {"sub", "a file\nwith newline"}
    assert entries["sub"].is_dir and entries["sub"].path == "/root/dir/sub"
    assert not entries["a file\nwith newline"].is_dir and entries["a file\nwith newline"].size == 1
    sub = tier.list_files(vm, "/root/dir/sub")
    assert [(f.name, f.size, f.is_dir) for f in sub] == [("data.bin", len(data), False)]
    with pytest.raises(NotFound):
        tier.read_file(vm, "/root/nope")
    with pytest.raises(NotFound):
        tier.list_files(vm, "/root/nope")
    with pytest.raises(BadRequest):
        tier.read_file(vm, "/root/dir")
    for bad in ("root/x", "/root/x\0y", ""):
        with pytest.raises(BadRequest):
            tier.read_file(vm, bad)
        with pytest.raises(BadRequest):
            tier.write_file(vm, bad, b"")
    with pytest.raises(TooLarge):
        tier.write_file(vm, "/root/big", b"\0" * (MAX_FILE_BYTES + 1))


def test_read_of_a_file_renamed_over_is_one_whole_version(tier, vm):
    """A file replaced by `mv` while it is read comes back as one of its versions, never the old bytes padded to
    the new size (the agent once sized the reply by the path, not by the file it had open: b'9\\n\\x00')."""
    loop = ("while :; do echo 9 > /root/race.a; mv /root/race.a /root/race; "
            "echo 1000000 > /root/race.b; mv /root/race.b /root/race; done")
    tier.exec(vm, "echo 9 > /root/race")
    pid = tier.exec(vm, f"sh -c '{loop}' >/dev/null 2>&1 & echo $!").stdout.strip()
    try:
        seen = {tier.read_file(vm, "/root/race") for _ in range(40)}
    finally:
        tier.exec(vm, f"kill {pid}")
    assert seen <= {b"9\n", b"1000000\n"}, seen


def test_pause_stops_the_guest(tier, vm):
    tier.exec(vm, f"sh -c '{COUNTER}' >/dev/null 2>&1 &")
    c0 = wait_counter(tier, vm, 2)
    tier.pause(vm)
    time.sleep(1.5)
    tier.resume(vm)
    c1 = counter(tier, vm)
    assert c1 - c0 <= 3  # ~7 ticks would have passed had it run
    wait_counter(tier, vm, c1 + 1)


@pytest.fixture(scope="module")
def counter_snap(tier, vm):
    """A checkpoint of `vm` with the counter loop running (started by test_pause_stops_the_guest or here)."""
    if tier.exec(vm, "test -s /root/counter.pid && kill -0 $(cat /root/counter.pid)").exit_code != 0:
        tier.exec(vm, f"sh -c '{COUNTER}' >/dev/null 2>&1 &")
    wait_counter(tier, vm, 3)
    tier.write_file(vm, "/root/who", b"parent")
    t0 = time.monotonic()
    s = snap(tier, vm, "snap-counter")
    print(f"checkpoint (running, 256 MiB): {time.monotonic() - t0:.2f} s, mem {s.meta['mem_bytes'] / 1e6:.0f} MB")
    return s, counter(tier, vm)


def test_restore_continues_memory_state(tier, vm, counter_snap):
    s, c_ckpt = counter_snap
    pid = tier.read_file(vm, "/root/counter.pid").strip()
    c_parent = wait_counter(tier, vm, c_ckpt + 5)  # the original keeps running after the checkpoint
    t0 = time.monotonic()
    tier.create("restored", LIM, snapshot=s)
    print(f"restore: {time.monotonic() - t0:.2f} s")
    try:
        c0 = counter(tier, "restored")
        # it resumes from the checkpoint's value (not from 0, and not from where the original is now)
        assert 0 < c0 < c_parent and c0 <= c_ckpt + 3
        c1 = wait_counter(tier, "restored", c0 + 2)
        assert c1 > c0
        # the very same process continues (same pid, still the loop): memory came back, nothing restarted
        assert tier.read_file("restored", "/root/counter.pid").strip() == pid
        r = tier.exec("restored", f"kill -0 {pid.decode()} && cat /proc/{pid.decode()}/cmdline | tr '\\0' ' '")
        assert r.exit_code == 0 and "while" in r.stdout
        assert tier.read_file("restored", "/root/who") == b"parent"
        # the sandbox env given at create survives in the snapshot
        assert tier.exec("restored", "echo $K3_SANDBOX").stdout == "main\n"
    finally:
        tier.kill("restored")


def test_forks_are_independent(tier, vm, counter_snap):
    s, c_ckpt = counter_snap
    t0 = time.monotonic()
    tier.create("fork-a", LIM, snapshot=s)
    t1 = time.monotonic()
    tier.create("fork-b", LIM, snapshot=s)
    print(f"fork restores: {t1 - t0:.2f} s, {time.monotonic() - t1:.2f} s")
    try:
        tier.write_file("fork-a", "/root/who", b"a")
        tier.write_file("fork-b", "/root/who", b"b")
        tier.write_file("fork-a", "/root/only-a", b"1")
        assert tier.read_file("fork-a", "/root/who") == b"a"
        assert tier.read_file("fork-b", "/root/who") == b"b"
        assert tier.read_file(vm, "/root/who") == b"parent"
        with pytest.raises(NotFound):
            tier.read_file("fork-b", "/root/only-a")
        with pytest.raises(NotFound):
            tier.read_file(vm, "/root/only-a")
        # stop the counter in fork a only: b's keeps going, a's stays put
        pid = tier.read_file("fork-a", "/root/counter.pid").decode().strip()
        tier.exec("fork-a", f"kill -STOP {pid}")
        time.sleep(0.5)
        a0, b0 = counter(tier, "fork-a"), counter(tier, "fork-b")
        b1 = wait_counter(tier, "fork-b", b0 + 3)
        assert counter(tier, "fork-a") == a0 and b1 > b0
        assert a0 >= c_ckpt and b0 >= c_ckpt  # both started from the checkpoint's count
    finally:
        tier.kill("fork-a")
        tier.kill("fork-b")


def test_checkpoint_chain(tier, state_dir):
    tier.create("chain", LIM)
    snaps: list[SnapshotInfo] = []
    try:
        for k in (1, 2, 3):
            tier.write_file("chain", "/root/state", f"v{k}".encode())
            tier.write_file("chain", f"/root/stage{k}", b"x")
            tier.exec("chain", f"echo {k} > /tmp/in-memory-too")
            if k == 2:
                tier.pause("chain")  # a checkpoint of a paused sandbox leaves it paused
            t0 = time.monotonic()
            snaps.append(snap(tier, "chain", f"chain-{k}", snaps[-1] if snaps else None))
            print(f"checkpoint {k}: {time.monotonic() - t0:.2f} s")
            if k == 2:
                with pytest.raises(InvalidState):
                    tier.exec("chain", "true")
                snaps.append(snap(tier, "chain", "chain-2b", snaps[-1]))  # twice while paused
                tier.resume("chain")
        tier.write_file("chain", "/root/state", b"v4")
        # the disk layers form one backing chain: base <- chain-1 <- chain-2 <- chain-2b <- chain-3 <- live
        disks = [Path(s.meta["disk"]) for s in snaps]
        assert qcow2_backing(disks[1]) == str(disks[0])
        assert qcow2_backing(disks[2]) == str(disks[1])
        assert qcow2_backing(disks[3]) == str(disks[2])
        assert qcow2_backing(Path(tier._vms["chain"].info["disk"])) == str(disks[3])
        for k, s in [(1, snaps[0]), (2, snaps[1]), (2, snaps[2]), (3, snaps[3])]:
            sid = f"chain-r-{s.snapshot_id}"
            tier.create(sid, LIM, snapshot=s)
            try:
                assert tier.read_file(sid, "/root/state") == f"v{k}".encode()
                names = {f.name for f in tier.list_files(sid, "/root")}
                assert {f"stage{j}" for j in (1, 2, 3)} & names == {f"stage{j}" for j in range(1, k + 1)}
                assert tier.exec(sid, "cat /tmp/in-memory-too").stdout == f"{k}\n"
            finally:
                tier.kill(sid)
        assert tier.read_file("chain", "/root/state") == b"v4"
        # deleting a snapshot others build on keeps its disk layer until nothing uses it
        tier.delete_snapshot(snaps[0])
        assert not Path(snaps[0].meta["mem"]).exists() and disks[0].exists()
        tier.kill("chain")
        for s in reversed(snaps[1:]):
            tier.delete_snapshot(s)
        assert not any(d.exists() for d in disks)
        assert not [p for p in (state_dir / "snapshots").iterdir() if p.name.startswith("chain-")]
    finally:
        tier.kill("chain")


def test_recover_after_manager_restart(tier, state_dir):
    tier.create("rec", LIM)
    try:
        tier.write_file("rec", "/root/f", b"checkpointed")
        s = snap(tier, "rec", "rec-1")
        tier.write_file("rec", "/root/f", b"later")
        meta = {"dir": str(state_dir / "sandboxes" / "rec")}
        tier._vms["rec"].close_conns()  # the old manager process is gone: so are its connections
        # a new tier object (a new manager process) re-attaches to the running QEMU; it comes back paused
        t2 = VMTier(state_dir)
        t2.recover("rec", meta, State.PAUSED)
        with pytest.raises(InvalidState):
            t2.exec("rec", "true")
        t2.resume("rec")
        assert t2.read_file("rec", "/root/f") == b"later"
        # QEMU dies: recovery restores the last checkpoint
        pid = t2._vms["rec"].pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while qemu_pids(str(state_dir / "sandboxes" / "rec")) and time.monotonic() < deadline:
            time.sleep(0.05)
        t3 = VMTier(state_dir)
        t3.recover("rec", meta, State.PAUSED)
        t3.resume("rec")
        assert t3.read_file("rec", "/root/f") == b"checkpointed"
        t3.kill("rec")
        t3.delete_snapshot(s)
        with pytest.raises(SandboxError):
            VMTier(state_dir).recover("rec", meta, State.PAUSED)
    finally:
        tier.kill("rec")


def test_network_option(tier):
    tier.create("net", Limits(memory_mb=128, network=True))  # below the 256 MiB minimum: raised to it
    try:
        assert tier._vms["net"].info["memory_mb"] == 256
        r = tier.exec("net", "ip -4 addr show eth0; ip route")
        assert "10.0.2.15/24" in r.stdout and "default via 10.0.2.2" in r.stdout
        assert tier.exec("net", "ping -c 1 -W 5 10.0.2.2").exit_code == 0  # slirp's gateway answers
    finally:
        tier.kill("net")
    assert "eth0" not in tier.exec("main", "ip link").stdout  # the default: no NIC at all


def test_kill_leaves_nothing(tier, vm, state_dir):
    sb = state_dir / "sandboxes" / "doomed"
    tier.create("doomed", LIM)
    assert qemu_pids(str(sb))
    tier.exec("doomed", "sleep 1000 >/dev/null 2>&1 &")
    tier.kill("doomed")
    assert not qemu_pids(str(sb)) and not sb.exists()
    tier.kill("doomed")  # idempotent
    tier.kill(vm)
    assert not qemu_pids(str(state_dir / "sandboxes"))
    assert list((state_dir / "sandboxes").iterdir()) == []


def test_qmp_client_keeps_events_sent_before_the_greeting(tmp_path):
    """On a reconnect (a restarted manager) QEMU may flush events queued for the previous client ahead of the
    greeting: the client keeps them as events and negotiates; a first message that is neither fails clearly.
    A fake QMP server on a unix socket, no QEMU needed."""
    import json
    import socket
    import threading

    from k3.env.vm.channels import QMP, QMPError

    def serve(path, first):
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)

        def run():
            conn, _ = srv.accept()
            with conn:
                for m in first:
                    conn.sendall(json.dumps(m).encode() + b"\n")
                if conn.recv(4096):  # qmp_capabilities
                    conn.sendall(b'{"return": {}}\n')
                conn.recv(1)
            srv.close()

        threading.Thread(target=run, daemon=True).start()

    event = {"timestamp": {"seconds": 1, "microseconds": 2}, "event": "RESUME"}
    greeting = {"QMP": {"version": {}, "capabilities": []}}
    path = str(tmp_path / "a.sock")
    serve(path, [event, greeting])
    q = QMP(path, timeout=5)
    assert q.events == [event]
    q.close()
    path = str(tmp_path / "b.sock")
    serve(path, [{"return": {}}])
    with pytest.raises(QMPError, match="not a QMP greeting"):
        QMP(path, timeout=5)
