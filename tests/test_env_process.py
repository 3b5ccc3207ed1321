"""Process tier (k3.env.process): exec, pause/resume, filesystem checkpoints, forks, isolation, limits, cleanup,
recovery. Needs root, cgroups (v1 freezer, memory, pids; or v2 with memory, pids) and overlayfs; skipped
elsewhere."""

import gc
import itertools
import json
import os
import socket
import time
from pathlib import Path

import pytest

from k3.env import process as proc_mod
from k3.env.base import BadRequest, InvalidState, Limits, NotFound, SnapshotInfo, State, TooLarge
from k3.env.process import CG_PARENT, CGROUP_ROOT, ProcessTier, cgroup_mode

pytestmark = pytest.mark.skipif(not ProcessTier.available()[0],
                                reason=f"process tier: {ProcessTier.available()[1]}")
V2 = cgroup_mode()[0] == "v2"


def cg_file(tier, sid: str, controller: str, name: str) -> Path:
    """A sandbox's cgroup file: `<controller>/k3sbx/<sid>-<tag>/<name>` on v1, `k3sbx/<sid>-<tag>/<name>` on v2."""
    d = f"{sid}-{tier._tag}"
    return CGROUP_ROOT / CG_PARENT / d / name if V2 else CGROUP_ROOT / controller / CG_PARENT / d / name


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    t = ProcessTier(tmp_path_factory.mktemp("ptier"))
    yield t
    t.close()


_ids = itertools.count(1)


def uid(name):
    """A sandbox id unique to this test run (mount and cgroup checks match by id)."""
    return f"{name}-{os.getpid()}"


@pytest.fixture
def sbx(tier):
    """make(limits=None, **create_kwargs) -> a new sandbox id on the shared tier; all are killed afterwards."""
    made = []

    def make(limits=None, **kw):
        sid = uid(f"t{next(_ids)}")
        tier.create(sid, limits or Limits(), **kw)
        made.append(sid)
        return sid

    yield make
    for sid in made:
        tier.kill(sid)


def snap(sid, snapshot_id, meta, parent=None):
    return SnapshotInfo(snapshot_id, sid, "process", parent, time.time(), meta)


def sh(tier, sid, cmd, **kw):
    r = tier.exec(sid, cmd, **kw)
    assert r.exit_code == 0, (cmd, r)
    return r.stdout


def leftovers(tier, sid, pids=(), cgroups=None):
    """What a dead sandbox might leave: mounts naming its dirs (in any process's mount namespace: the overlay
    options name them relative to the state dir), cgroup dirs, processes, files."""
    sdir = str(tier.state_dir / "sandboxes" / sid)
    mounts = []
    for p in ["self"] + [d for d in os.listdir("/proc") if d.isdigit()]:
        try:
            text = Path(f"/proc/{p}/mountinfo").read_text()
        except OSError:
            continue
        mounts += [f"{p}: {line}" for line in text.splitlines() if f"sandboxes/{sid}/" in line]
    cgroups = [str(d) for d in (cgroups or tier._cgroups_of(sid)) if d.exists()]
    alive = [pid for pid in pids if proc_mod._proc_start(pid) and _state(pid) != "Z"]
    return {"mounts": mounts, "cgroups": cgroups, "procs": alive, "files": os.path.exists(sdir)}


def _state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def clean(d):
    return not any(d.values())


# --- exec -------------------------------------------------------------------------------------------------------
def test_exec_basics(tier, sbx):
    s = sbx()
    assert sh(tier, s, "echo hi") == "hi\n"
    r = tier.exec(s, "echo out; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("out\n", "err\n", 3, False)
    assert sh(tier, s, "echo $FOO-$HOME", env={"FOO": "bar"}) == "bar-/root\n"
    assert sh(tier, s, "pwd", cwd="/tmp") == "/tmp\n"
    assert sh(tier, s, ["cat"], stdin=b"piped\n") == "piped\n"
    assert sh(tier, s, ["/bin/echo", "a b", "c"]) == "a b c\n"
    assert tier.exec(s, "no-such-binary").exit_code == 127
    assert tier.exec(s, ["/no/such/binary"]).exit_code == 127
    assert sh(tier, s, "python3 -c 'print(1)'") == "1\n"
    assert sh(tier, s, "/bin/sh -c 'echo hi'") == "hi\n"
    assert sh(tier, s, "id -u; id -g") == "0\n0\n"
    with pytest.raises(BadRequest):
        tier.exec(s, "true", cwd="/no/such/dir")
    with pytest.raises(NotFound):
        tier.exec("nope", "true")
    # env, argv and cwd only ever reach the sandboxed command (no host-side helper sees LD_PRELOAD & co.)
    assert sh(tier, s, "echo $LD_PRELOAD", env={"LD_PRELOAD": "/root/none.so"}).endswith("/root/none.so\n")
    sh(tier, s, "ln -s / /root/up; ln -s /etc /root/etc-link")
    assert sh(tier, s, "pwd -P; ls", cwd="/root/etc-link") == "/etc\n" + sh(tier, s, "ls /etc")
    assert sh(tier, s, "ls ../..", cwd="/root/up") == sh(tier, s, "ls /")
    with pytest.raises(BadRequest):
        tier.exec(s, "true", cwd="/../..")
    # exec returns when the command exits, even if a background child keeps stdout open
    r = tier.exec(s, "sleep 5 & echo started", timeout=10)
    assert r.stdout == "started\n" and r.duration_s < 3


def test_exec_concurrent_and_big_io(tier, sbx):
    from concurrent.futures import ThreadPoolExecutor
    s = sbx()
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: tier.exec(s, f"sleep 0.5; echo {i}").stdout, range(8)))
    assert outs == [f"{i}\n" for i in range(8)] and time.monotonic() - t0 < 3
    data = os.urandom(3 << 20)
    assert sh(tier, s, ["sh", "-c", "wc -c; echo done >&2"], stdin=data) == f"{len(data)}\n"
    assert len(sh(tier, s, "head -c 5000000 /dev/zero")) == 5_000_000


def test_exec_output_cap(tier, sbx, monkeypatch):
    monkeypatch.setattr(proc_mod.tier, "MAX_OUTPUT_BYTES", 1000)
    s = sbx()
    r = tier.exec(s, "head -c 5000 /dev/zero | tr '\\0' x")
    assert r.stdout == "x" * 1000 and "truncated" in r.stderr and r.exit_code == 0


def test_exec_timeout_kills_everything(tier, sbx):
    s = sbx()
    t0 = time.monotonic()
    r = tier.exec(s, "sleep 30 & sleep 30; echo never", timeout=1)
    assert r.timed_out and r.exit_code == proc_mod.TIMEOUT_EXIT and "never" not in r.stdout
    assert time.monotonic() - t0 < 4
    time.sleep(0.1)
    ps = sh(tier, s, "ps -eo comm")
    assert "sleep" not in ps, ps
    # only the unshare and the init stay in the sandbox's cgroup between execs
    assert len(proc_mod._cg_procs(tier._freezer(tier._table.sandboxes[s]))) == 2


# --- pause / resume ---------------------------------------------------------------------------------------------
def _cpu_ns(tier, sid):
    if V2:
        stat = dict(x.split() for x in cg_file(tier, sid, "", "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) * 1000
    return int(cg_file(tier, sid, "cpuacct", "cpuacct.usage").read_text())


def _loop_ticks(tier, sid):
    """utime+stime (clock ticks) of the busy loop, found among the sandbox's processes by host pid."""
    for pid in proc_mod._cg_procs(tier._freezer(tier._table.sandboxes[sid])):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if "(k3busy)" in stat:
            f = stat.rsplit(")", 1)[1].split()
            return int(f[11]) + int(f[12])
    raise AssertionError("busy loop not found")


def test_pause_resume(tier, sbx):
    s = sbx()
    tier.write_file(s, "/root/before.txt", b"kept")
    sh(tier, s, "cp /bin/sh /tmp/k3busy; nohup /tmp/k3busy -c 'while :; do :; done' >/dev/null 2>&1 &")
    time.sleep(0.3)
    t1 = _loop_ticks(tier, s)
    time.sleep(0.3)
    assert _loop_ticks(tier, s) > t1  # it runs
    tier.pause(s)
    tier.pause(s)  # idempotent
    cg = V2 or (CGROUP_ROOT / "cpuacct" / CG_PARENT / f"{s}-{tier._tag}").exists()
    c1, t1 = (_cpu_ns(tier, s) if cg else 0), _loop_ticks(tier, s)
    time.sleep(0.6)
    assert _loop_ticks(tier, s) == t1  # frozen: no CPU time at all
    if cg:
        assert _cpu_ns(tier, s) == c1
    with pytest.raises(InvalidState):
        tier.exec(s, "true")
    assert tier.read_file(s, "/root/before.txt") == b"kept"  # the file API works while paused
    tier.resume(s)
    time.sleep(0.3)
    assert _loop_ticks(tier, s) > t1
    assert sh(tier, s, "cat /root/before.txt") == "kept"


# --- checkpoints, restores, forks ---------------------------------------------------------------------------
def _du(path):
    total = 0
    for root, dirs, files in os.walk(path):
        for f in files:
            total += os.lstat(os.path.join(root, f)).st_size
    return total


def test_checkpoint_chain(tier, sbx):
    s = sbx()
    sh(tier, s, "echo 1 > /root/a; head -c 1000000 /dev/urandom > /root/big; rm /etc/hosts; "
                "mkdir -p /root/d/sub; echo x > /root/d/sub/f")
    m1 = tier.checkpoint(s, f"{s}-S1", None)
    assert sh(tier, s, "cat /root/a") == "1\n"  # still running, same files
    sh(tier, s, "echo 2 > /root/a; echo 1 > /root/b; mv /root/d /root/d2")
    m2 = tier.checkpoint(s, f"{s}-S2", snap(s, f"{s}-S1", m1))
    tier.pause(s)
    tier.write_file(s, "/root/a", b"3\n")
    assert {f.name for f in tier.list_files(s, "/root")} >= {"a", "b", "big", "d2"}
    tier.resume(s)
    sh(tier, s, "rm /root/b")
    tier.pause(s)
    m3 = tier.checkpoint(s, f"{s}-S3", snap(s, f"{s}-S2", m2))
    assert tier._table.sandboxes[s].state is State.PAUSED  # a paused sandbox stays paused
    tier.resume(s)

    assert m3["layers"][1:] == m2["layers"] and m2["layers"][1:] == m1["layers"] and len(m3["layers"]) == 3
    # incremental: S2's layer holds what changed (a, b, the renamed dir), not the 1 MB file sealed in S1
    assert _du(m1["layers"][0]) > 1_000_000 and _du(m2["layers"][0]) < 10_000
    assert sorted(os.listdir(Path(m2["layers"][0]) / "root")) == ["a", "b", "d", "d2"]  # d: whiteout

    expect = [(m1, "1\n", None, "d"), (m2, "2\n", "1\n", "d2"), (m3, "3\n", None, "d2")]
    for i, (meta, a, b, d) in enumerate(expect):
        r = sbx(snapshot=snap(s, f"S{i + 1}", meta))
        assert sh(tier, r, "cat /root/a") == a
        assert tier.exec(r, "cat /root/b").stdout == (b or "")
        assert tier.exec(r, "test -e /root/b").exit_code == (0 if b else 1)
        assert tier.exec(r, "test -e /etc/hosts").exit_code == 1  # a deleted base file stays deleted
        with pytest.raises(NotFound):
            tier.read_file(r, "/etc/hosts")
        assert sh(tier, r, f"cat /root/{d}/sub/f") == "x\n"
        assert sh(tier, r, "ls /root").split() == sorted(["a", "big", d] + (["b"] if b else []))


def test_fork_from_snapshot(tier, sbx):
    s = sbx()
    sh(tier, s, "echo parent > /root/p; nohup sleep 60 >/dev/null 2>&1 &")
    meta = tier.checkpoint(s, f"{s}-F", None)
    assert "sleep" not in sh(tier, s, "ps -eo comm")  # documented: processes do not survive a checkpoint
    kids = [sbx(snapshot=snap(s, f"{s}-F", meta)) for _ in range(4)]
    for i, k in enumerate(kids):
        assert sh(tier, k, "cat /root/p") == "parent\n"
        sh(tier, k, f"echo {i} > /root/mine; echo {i} >> /root/p")
    for i, k in enumerate(kids):
        assert sh(tier, k, "cat /root/mine") == f"{i}\n"
        assert sh(tier, k, "cat /root/p") == f"parent\n{i}\n"
    assert sh(tier, s, "cat /root/p; test ! -e /root/mine && echo none") == "parent\nnone\n"


def test_deep_layer_stack_mounts(tmp_path):
    """200 layers with long names (far beyond one page of mount options) stack fine, newest on top."""
    import subprocess
    import sys
    n, layers = 200, []
    for i in range(n):
        d = tmp_path / f"layer-{i:04d}-{'x' * 40}"
        d.mkdir()
        (d / "f").write_text(str(i))
        layers.append(str(d))
    (tmp_path / "u").mkdir(), (tmp_path / "w").mkdir(), (tmp_path / "m").mkdir()
    fs_dir = str(Path(proc_mod.__file__).parents[1])  # k3/env, where _fs.py is
    code = (f"import sys; sys.path.insert(0, {fs_dir!r}); import _fs; "
            f"_fs.mount_overlay({str(tmp_path / 'm')!r}, {layers[::-1]!r}, {str(tmp_path / 'u')!r}, "
            f"{str(tmp_path / 'w')!r}, {proc_mod.OVERLAY_OPTIONS!r}); print(open({str(tmp_path / 'm' / 'f')!r}).read())")
    r = subprocess.run(["unshare", "-m", sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == str(n - 1), r.stderr


def test_delete_snapshot_keeps_shared_layers(tier, sbx):
    s = sbx()
    m1 = tier.checkpoint(s, f"{s}-D1", None)
    sh(tier, s, "echo 2 > /root/x")
    m2 = tier.checkpoint(s, f"{s}-D2", None)
    tier.delete_snapshot(snap(s, f"{s}-D1", m1))
    assert os.path.isdir(m1["layers"][0])  # D2 and the sandbox stack it
    tier.kill(s)
    tier.delete_snapshot(snap(s, f"{s}-D2", m2))
    assert not os.path.exists(m1["layers"][0]) and not os.path.exists(m2["layers"][0])
    assert not [p for p in Path(m1["layers"][0]).parent.glob(".*") if s in p.name]  # nor their metadata


# --- isolation --------------------------------------------------------------------------------------------------
def test_isolation_filesystem_and_privileges(tier, sbx, tmp_path):
    marker = Path("/tmp") / f"k3-host-marker-{os.getpid()}"
    marker.write_text("host")
    try:
        s = sbx()
        assert tier.exec(s, f"test -e {marker}").exit_code == 1
        inside = set(sh(tier, s, "ls -A /root").split())  # the host's /root is not there (but a bound interpreter)
        assert inside <= {".pyenv"} and not inside & (set(os.listdir("/root")) - {".pyenv"}), inside
        assert tier.exec(s, "ls /work").exit_code != 0
        assert "root:x:0:0" in sh(tier, s, "cat /etc/passwd")
        assert tier.exec(s, "cat /etc/shadow").exit_code != 0
        assert tier.exec(s, "touch /usr/bin/k3-x").exit_code != 0  # read-only binds
        # root inside, but without host privileges
        assert tier.exec(s, "mknod /tmp/vda b 254 0").exit_code != 0
        assert tier.exec(s, "mount -t tmpfs none /mnt").exit_code != 0
        assert tier.exec(s, "cat /proc/1/environ").exit_code != 0
        assert tier.exec(s, "ls /proc/1/root/").exit_code != 0
        assert tier.exec(s, "echo 1 > /proc/sys/vm/drop_caches").exit_code != 0
        # no cgroup namespace of its own, so no cgroupfs mount to lift its own limits from (nested userns too)
        for cmd in ("unshare -C true", "unshare -Ur -C true",
                    "unshare -m -C sh -c 'mount -t cgroup -o pids none /mnt && echo max > /mnt/pids.max'",
                    "unshare -m sh -c 'mount -t cgroup2 none /mnt && echo max > /mnt/pids.max'"):
            assert tier.exec(s, cmd).exit_code != 0, cmd
        pids_max = cg_file(tier, s, "pids", "pids.max")
        assert pids_max.read_text().strip() == str(Limits().pids + proc_mod.PIDS_OVERHEAD)
        assert Path("/proc/sys/user/max_cgroup_namespaces").read_text().strip() != "0"  # the host's is untouched
        # pid namespace: the init and this command's processes only
        pids = sh(tier, s, "ls /proc | grep -E '^[0-9]+$'").split()
        assert "1" in pids and len(pids) <= 4, pids
    finally:
        marker.unlink()


def test_isolation_network(tier, sbx):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        s = sbx()
        net_dev = "tail -n +3 /proc/net/dev"  # the interfaces, without iproute2 (not on every host)
        assert [ln.split(":")[0].strip() for ln in sh(tier, s, net_dev).splitlines()] == ["lo"]
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
        r = tier.exec(s, ["python3", "-c", code])
        assert r.exit_code != 0 and "connected" not in r.stdout
        # the sandbox's own loopback works
        r = tier.exec(s, ["python3", "-c", "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
                                           "socket.create_connection(s.getsockname()); print('ok')"])
        assert r.stdout == "ok\n", r
        # network=True shares the host's network: the host's interfaces, and its loopback server is reachable
        h = sbx(Limits(network=True))
        assert len(sh(tier, h, net_dev).splitlines()) == len(os.listdir("/sys/class/net"))
        assert sh(tier, h, ["python3", "-c", code]) == "connected\n"
    finally:
        srv.close()


def test_fork_bomb_hits_pids_limit(tier, sbx):
    s = sbx(Limits(pids=20))
    other = sbx()
    code = ("import os, time\nn = 0\ntry:\n    while n < 500:\n        if os.fork() == 0:\n            time.sleep(30)\n"
            "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)\n")
    r = tier.exec(s, ["python3", "-c", code], timeout=20)
    n, err = map(int, r.stdout.split())
    assert err == 11 and n <= 20, r  # EAGAIN from pids.max
    assert sh(tier, other, "echo fine") == "fine\n"  # neighbours and host unaffected
    assert os.system("true") == 0
    tier.kill(s)  # kills the 20 sleepers too
    assert clean(leftovers(tier, s))


def test_memory_hog_is_oom_killed(tier, sbx):
    s = sbx(Limits(memory_mb=64))
    r = tier.exec(s, ["python3", "-c", "b = b'x' * (128 << 20); print('survived')"], timeout=30)
    assert r.exit_code != 0 and "survived" not in r.stdout, r
    assert r.exit_code == 137  # SIGKILL by the cgroup's OOM killer
    assert sh(tier, s, "echo alive") == "alive\n"


# --- file API ---------------------------------------------------------------------------------------------------
def test_file_api(tier, sbx):
    s = sbx(Limits(file_mb=1))
    tier.write_file(s, "/root/new/dir/f.sh", b"#!/bin/sh\necho run\n", mode=0o755)
    assert tier.read_file(s, "/root/new/dir/f.sh") == b"#!/bin/sh\necho run\n"
    assert sh(tier, s, "stat -c '%u %g %a' /root/new/dir/f.sh; /root/new/dir/f.sh") == "0 0 755\nrun\n"
    assert [(f.name, f.is_dir, f.size) for f in tier.list_files(s, "/root/new/dir")] == [("f.sh", False, 19)]
    assert {"dir"} == {f.name for f in tier.list_files(s, "/root/new") if f.is_dir}
    tier.write_file(s, "relative.txt", b"r")
    assert sh(tier, s, "cat /relative.txt") == "r"
    for bad in ("../../etc/passwd", "/root/../../etc/passwd", "a\0b"):
        with pytest.raises(BadRequest):
            tier.read_file(s, bad)
        with pytest.raises(BadRequest):
            tier.write_file(s, bad, b"x")
    with pytest.raises(NotFound):
        tier.read_file(s, "/no/such/file")
    with pytest.raises(BadRequest):
        tier.read_file(s, "/root")  # a directory
    with pytest.raises(TooLarge):
        tier.write_file(s, "/root/big", b"x" * (2 << 20))
    with pytest.raises(BadRequest):
        tier.write_file(s, "/usr/k3-nope", b"x")  # read-only bind
    sh(tier, s, "mkfifo /root/fifo")
    with pytest.raises(BadRequest):
        tier.read_file(s, "/root/fifo")  # no hang on a FIFO

    # symlinks resolve inside the sandbox root, never to the host
    sh(tier, s, "ln -s /etc/shadow /root/sh; ln -s /etc/passwd /root/pw; ln -s ../../../../../../etc/passwd /root/up;"
                "ln -s / /root/slash; ln -s /proc/1/root /root/magic")
    with pytest.raises(NotFound):
        tier.read_file(s, "/root/sh")  # the host has /etc/shadow, the sandbox does not
    host = Path("/etc/passwd").read_bytes()
    for link in ("/root/pw", "/root/up", "/root/slash/etc/passwd"):
        data = tier.read_file(s, link)
        assert data == tier.read_file(s, "/etc/passwd") and data != host
    with pytest.raises((BadRequest, NotFound)):
        tier.read_file(s, "/root/magic/etc/passwd")
    tier.write_file(s, "/root/pw", b"root:x:0:0::/root:/bin/sh\n")  # writes through the link, inside
    assert sh(tier, s, "cat /etc/passwd") == "root:x:0:0::/root:/bin/sh\n"
    assert Path("/etc/passwd").read_bytes() == host


# --- cleanup and recovery -------------------------------------------------------------------------------------
def test_kill_leaves_nothing(tier):
    kz = uid("kz")
    tier.create(kz, Limits())
    sb = tier._table.sandboxes[kz]
    sh(tier, kz, "nohup sleep 60 >/dev/null 2>&1 & echo x > /root/f")
    pids = [sb.init_pid] + proc_mod._cg_procs(tier._freezer(sb))
    alive = leftovers(tier, kz, pids)
    assert alive["mounts"] and alive["cgroups"] and len(alive["procs"]) >= 3  # the checks do see a live one
    tier.pause(kz)
    tier.kill(kz)
    assert clean(leftovers(tier, kz, pids)), leftovers(tier, kz, pids)
    tier.kill(kz)  # idempotent
    tier.kill("never-existed")
    with pytest.raises(NotFound):
        tier.exec(kz, "true")


def test_close_and_gc_leave_nothing(tmp_path):
    t, g1, g2 = ProcessTier(tmp_path / "gc"), uid("g1"), uid("g2")
    for sid in (g1, g2):
        t.create(sid, Limits())
    t.exec(g1, "nohup sleep 60 >/dev/null 2>&1 &")
    t.pause(g2)
    boxes = list(t._table.sandboxes.values())
    pids = [sb.init_pid for sb in boxes] + [p for sb in boxes for p in proc_mod._cg_procs(t._freezer(sb))]
    where = {sb.sid: sb.cgroups for sb in boxes}
    probe = type("Probe", (), {"state_dir": t.state_dir})()
    del t, boxes
    gc.collect()
    for sid, cgroups in where.items():
        assert clean(leftovers(probe, sid, pids, cgroups)), leftovers(probe, sid, pids, cgroups)


def test_recover_after_crash(tmp_path):
    """A process creates and pauses a sandbox, then dies without cleanup; a new tier recovers it."""
    d, rc = tmp_path / "rec", uid("rc")
    r, w = os.pipe()
    import ctypes
    libc = ctypes.CDLL(None)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: adopt the crashed tier's orphans (no reaping pid 1 here)
    try:
        pid = os.fork()
        if pid == 0:  # the "server" that crashes
            code = 1
            try:
                os.close(r)
                t = ProcessTier(d)
                meta = t.create(rc, Limits())
                t.write_file(rc, "/root/state.txt", b"before crash")
                t.exec(rc, "echo more >> /root/state.txt")
                t.pause(rc)
                os.write(w, json.dumps(meta).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        meta = json.loads(os.read(r, 65536))
        os.close(r)
        assert os.waitpid(pid, 0)[1] == 0
        stale_init = meta["init_pid"]
        assert _state(stale_init) not in ("?", "Z")  # still there, frozen

        t2 = ProcessTier(d)
        t2.recover(rc, meta, State.PAUSED)
        assert proc_mod._proc_start(stale_init) == 0 or _state(stale_init) == "Z"
        assert t2.read_file(rc, "/root/state.txt") == b"before crashmore\n"
        with pytest.raises(InvalidState):
            t2.exec(rc, "true")
        t2.resume(rc)
        assert sh(t2, rc, "cat /root/state.txt; echo after >> /root/state.txt") == "before crashmore\n"
        t2.kill(rc)
        assert clean(leftovers(t2, rc, [stale_init]))
        t2.close()
    finally:
        libc.prctl(36, 0, 0, 0, 0)


def test_tarball_base(tier, sbx, tmp_path, monkeypatch):
    import tarfile
    src = tmp_path / "img"
    (src / "data").mkdir(parents=True)
    (src / "data" / "hello.txt").write_text("from tar")
    tb = tmp_path / "img.tar.gz"
    with tarfile.open(tb, "w:gz") as tf:
        tf.add(src, arcname=".")
    with pytest.raises(BadRequest, match="not allowed"):  # absolute paths only under the operator's base roots
        sbx(base=str(tb))
    monkeypatch.setattr(tier, "base_roots", [str(tmp_path)])
    s1, s2 = sbx(base=str(tb)), sbx(base=str(tb))
    assert tier.read_file(s1, "/data/hello.txt") == b"from tar"
    assert tier._table.sandboxes[s1].base == tier._table.sandboxes[s2].base  # extracted once
    assert tier.exec(s1, ["/bin/sh", "-c", "true"]).exit_code == 127  # no shell in this image
