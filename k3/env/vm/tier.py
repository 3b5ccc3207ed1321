"""The vm tier: one QEMU microvm per sandbox (see the package docstring for the design)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import re
import shlex
import shutil
import signal
import struct
import subprocess
import threading
import time
from pathlib import Path

from ..._atomic import atomic_write_json
from ..base import (MAX_FILE_BYTES, MAX_OUTPUT_BYTES, BadRequest, ExecResult, FileInfo, InvalidState, Limits,
                    NotFound, SandboxError, SnapshotInfo, State, Tier, TooLarge, Unavailable, command_argv)


from .channels import QMP, QMP_TIMEOUT_S, Agent, QMPError, _b64, _unb64

log = logging.getLogger("k3.env.vm")

QEMU = "qemu-system-x86_64"
QEMU_IMG = "qemu-img"
MIN_MEMORY_MB = 256
BOOT_TIMEOUT_S = 180.0  # TCG on a busy 2-core host: a boot normally takes 4–10 s
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_CWD = "/root"
SETUP_HINT = "run scripts/setup_vm.sh"
SCRIPT_INLINE_MAX = 4096  # the agent reads longer exec scripts with dd (no NUL terminator)
_ENV_NAME = re.compile(r"^[^=\0]+$")


def vm_dir() -> Path:
    """Where scripts/setup_vm.sh put the kernel, initramfs and base disk: $K3_VM_DIR or ~/.cache/k3/vm."""
    return Path(os.environ.get("K3_VM_DIR") or Path.home() / ".cache" / "k3" / "vm")


def _kernel(d: Path) -> Path | None:
    for name in ("vmlinux", "vmlinuz"):
        if (d / name).is_file() and (d / name).stat().st_size > 0:
            return d / name
    return None


def host_tsc_khz() -> int:
    """The host TSC frequency, which is the guest's under TCG (passed as tsc_early_khz)."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz").read_text().strip())
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                with contextlib.suppress(ValueError):
                    return max(1, int(float(line.split(":", 1)[1]) * 1000))
    return 2_000_000


def qcow2_backing(path: Path) -> str | None:
    """The backing file name stored in a qcow2 header (None if none / not qcow2)."""
    try:
        with open(path, "rb") as f:
            hdr = f.read(20)
            if len(hdr) < 20 or hdr[:4] != b"QFI\xfb":
                return None
            off, size = struct.unpack(">QI", hdr[8:20])
            if not off or not size:
                return None
            f.seek(off)
            return f.read(size).decode(errors="replace")
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie is dead
        st = Path(f"/proc/{pid}/stat").read_text()
        if st.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _pid_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""



# ---- one VM ------------------------------------------------------------------------------------------
class _VM:
    def __init__(self, sid: str, d: Path, info: dict):
        self.sid = sid
        self.dir = d
        self.info = info  # persisted as vm.json
        self.proc: subprocess.Popen | None = None
        self.qmp: QMP | None = None
        self.agent = Agent(info["agent_sock"])
        self.lock = threading.RLock()

    @property
    def pid(self) -> int | None:
        return self.info.get("pid")

    def save(self) -> None:
        atomic_write_json(self.dir / "vm.json", self.info, indent=1, sort_keys=True)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        pid = self.pid
        return bool(pid) and _pid_alive(pid) and str(self.dir) in _pid_cmdline(pid)

    def close_conns(self) -> None:
        if self.qmp is not None:
            self.qmp.close()
            self.qmp = None
        self.agent.close()

    def qmp_cmd(self, cmd: str, args: dict | None = None, timeout: float = QMP_TIMEOUT_S,
                fds: list[int] | None = None):
        if self.qmp is None:
            if not self.alive():
                raise SandboxError(f"sandbox {self.sid}: its QEMU process is gone")
            self.qmp = QMP(self.info["qmp_sock"])
        try:
            return self.qmp.execute(cmd, args, timeout=timeout, fds=fds)
        except (OSError, TimeoutError, ConnectionError, ValueError) as e:
            self.qmp.close()
            self.qmp = None
            raise QMPError(f"sandbox {self.sid}: QMP {cmd} failed: {type(e).__name__}: {e}") from e


class VMTier(Tier):
    name = "vm"

    def __init__(self, state_dir: Path):
        super().__init__(state_dir)
        self.art = vm_dir()
        self.sb_root = self.state_dir / "sandboxes"
        self.snap_root = self.state_dir / "snapshots"
        self.sb_root.mkdir(parents=True, exist_ok=True)
        self.snap_root.mkdir(parents=True, exist_ok=True)
        self._vms: dict[str, _VM] = {}
        self._lock = threading.Lock()
        self.accel = os.environ.get("K3_VM_ACCEL", "tcg")  # kvm needs a guest the host's KVM can run

    # ---- availability ------------------------------------------------------------------------------
    @classmethod
    def available(cls) -> tuple[bool, str]:
        for exe in (QEMU, QEMU_IMG):
            if shutil.which(exe) is None:
                return False, f"{exe} not found; {SETUP_HINT}"
        d = vm_dir()
        if _kernel(d) is None:
            return False, f"no guest kernel in {d}; {SETUP_HINT}"
        for name in ("initramfs.cpio.gz", "base.qcow2"):
            if not (d / name).exists():
                return False, f"no {name} in {d}; {SETUP_HINT}"
        return True, ""

    # ---- helpers -----------------------------------------------------------------------------------
    def _sb_dir(self, sid: str) -> Path:
        if not sid or "/" in sid or sid.startswith("."):
            raise BadRequest(f"bad sandbox id {sid!r}")
        return self.sb_root / sid

    def _snap_dir(self, snap_id: str) -> Path:
        if not snap_id or "/" in snap_id or snap_id.startswith("."):
            raise BadRequest(f"bad snapshot id {snap_id!r}")
        return self.snap_root / snap_id

    @staticmethod
    def _sock_dir(d: Path) -> Path:
        """Unix socket paths are limited to 107 bytes: long sandbox dirs get a private dir under /tmp."""
        if len(str(d)) + len("/agent.sock") < 100:
            return d
        h = hashlib.sha256(str(d).encode()).hexdigest()[:20]
        base = Path("/tmp") / f"k3vm-{os.getuid()}"
        base.mkdir(mode=0o700, exist_ok=True)
        os.chmod(base, 0o700)
        sd = base / h
        sd.mkdir(mode=0o700, exist_ok=True)
        return sd

    def _get(self, sid: str) -> _VM:
        with self._lock:
            vm = self._vms.get(sid)
        if vm is None:
            raise NotFound(f"vm sandbox {sid!r} not found (not created here or not recovered)")
        return vm

    def _running_vm(self, sid: str) -> _VM:
        vm = self._get(sid)
        if vm.info.get("paused"):
            raise InvalidState(f"sandbox {sid} is paused")
        return vm

    def _qemu_args(self, vm: _VM, disk: Path, incoming: Path | None) -> list[str]:
        i = vm.info
        kernel = Path(i["kernel"])
        append = " ".join([
            "console=ttyS0", "quiet", "panic=-1", "reboot=t",
            f"tsc_early_khz={i['tsc_khz']}", "tsc=reliable",
            f"k3.net={1 if i['network'] else 0}",
        ] + os.environ.get("K3_VM_APPEND", "").split())
        args = [
            QEMU, "-name", f"k3-vm-{vm.sid}",
            "-machine", "microvm", "-accel", i.get("accel", "tcg"), "-cpu", i.get("cpu", "qemu64"),
            "-m", str(i["memory_mb"]), "-smp", str(i["smp"]),
            "-nodefaults", "-no-user-config", "-nographic", "-display", "none", "-no-reboot",
            "-kernel", str(kernel), "-initrd", i["initrd"], "-append", append,
            "-chardev", f"file,id=con,path={vm.dir / 'console.log'}", "-serial", "chardev:con",
            "-blockdev", f"driver=file,filename={disk},node-name=file{i['disk_n']},discard=unmap",
            "-blockdev", f"driver=qcow2,file=file{i['disk_n']},node-name=disk{i['disk_n']}",
            "-device", f"virtio-blk-device,drive=disk{i['disk_n']},id=vda",
            "-device", "virtio-serial-device,id=vser",
            "-chardev", f"socket,id=agent,path={i['agent_sock']},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=k3.agent,id=agentport",
            "-chardev", f"socket,id=qmp,path={i['qmp_sock']},server=on,wait=off",
            "-mon", "chardev=qmp,mode=control",
        ]
        if i["network"]:
            args += ["-netdev", "user,id=net0", "-device", "virtio-net-device,netdev=net0,id=net0dev"]
        else:
            args += ["-nic", "none"]
        if incoming is not None:
            args += ["-S", "-incoming", f"exec:cat {shlex.quote(str(incoming))}"]
        return args

    def _spawn(self, vm: _VM, disk: Path, incoming: Path | None) -> None:
        for s in (vm.info["qmp_sock"], vm.info["agent_sock"]):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(s)
        args = self._qemu_args(vm, disk, incoming)
        logf = open(vm.dir / "qemu.log", "ab")
        try:
            vm.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                       start_new_session=True, cwd=vm.dir)
        finally:
            logf.close()
        vm.info["pid"] = vm.proc.pid
        vm.save()
        deadline = time.monotonic() + 30
        while True:
            if vm.proc.poll() is not None:
                raise SandboxError(f"QEMU exited with {vm.proc.returncode}: {self._qemu_log_tail(vm)}")
            try:
                vm.qmp = QMP(vm.info["qmp_sock"], timeout=10)
                break
            except (OSError, ConnectionError, TimeoutError, ValueError):
                if time.monotonic() > deadline:
                    raise SandboxError(f"QEMU's QMP socket did not come up: {self._qemu_log_tail(vm)}")
                time.sleep(0.02)

    @staticmethod
    def _qemu_log_tail(vm: _VM) -> str:
        with contextlib.suppress(OSError):
            return (vm.dir / "qemu.log").read_text(errors="replace")[-2000:].strip()
        return ""

    def _new_vm(self, sid: str, limits: Limits, network: bool | None = None, memory_mb: int | None = None,
                smp: int | None = None, env: dict | None = None) -> _VM:
        d = self._sb_dir(sid)
        if d.exists():
            raise SandboxError(f"vm sandbox dir {d} already exists")
        d.mkdir(parents=True)
        sd = self._sock_dir(d)
        kernel = _kernel(self.art)
        if kernel is None:
            raise Unavailable(f"no guest kernel in {self.art}; {SETUP_HINT}")
        info = {
            "sid": sid,
            "memory_mb": memory_mb or max(MIN_MEMORY_MB, int(limits.memory_mb)),
            "smp": smp or max(1, min(int(round(limits.cpus)), os.cpu_count() or 1)),
            "network": bool(limits.network if network is None else network),
            "kernel": str(kernel), "initrd": str(self.art / "initramfs.cpio.gz"),
            "tsc_khz": host_tsc_khz(), "accel": self.accel, "cpu": os.environ.get("K3_VM_CPU", "qemu64"),
            "qmp_sock": str(sd / "qmp.sock"), "agent_sock": str(sd / "agent.sock"), "sock_dir": str(sd),
            "disk_n": 0, "disk": None, "last_snapshot": None, "paused": False, "pid": None,
            "env": dict(env or {}),
        }
        vm = _VM(sid, d, info)
        vm.save()
        with self._lock:
            self._vms[sid] = vm
        return vm

    def _create_overlay(self, path: Path, backing: Path) -> None:
        r = subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(backing), "-u",
                            str(path), str(self._virtual_size(backing))], capture_output=True, text=True)
        if r.returncode != 0:
            raise SandboxError(f"qemu-img create {path}: {r.stderr.strip()}")

    @staticmethod
    def _virtual_size(path: Path) -> int:
        with open(path, "rb") as f:
            hdr = f.read(32)
        if hdr[:4] != b"QFI\xfb":
            raise SandboxError(f"{path} is not a qcow2 image")
        return struct.unpack(">Q", hdr[24:32])[0]

    def _restore_into(self, vm: _VM, mem: Path, disk_parent: Path) -> None:
        """Start vm's QEMU from a memory file + a new overlay over disk_parent; leaves it paused."""
        n = vm.info["disk_n"] = vm.info.get("disk_n", 0) + (1 if vm.info.get("disk") else 0)
        disk = vm.dir / f"disk-{n}.qcow2"
        self._create_overlay(disk, disk_parent)
        vm.info["disk"] = str(disk)
        self._spawn(vm, disk, incoming=mem)
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:
            st = vm.qmp_cmd("query-status")
            if st.get("status") != "inmigrate":
                break
            if time.monotonic() > deadline:
                raise SandboxError("restoring the memory snapshot timed out")
            time.sleep(0.01)
        mig = vm.qmp_cmd("query-migrate")
        if st.get("status") not in ("paused", "prelaunch") or mig.get("status") == "failed":
            raise SandboxError(f"restore failed: status {st.get('status')}, migration {mig}: "
                               f"{self._qemu_log_tail(vm)}")

    # ---- lifecycle ---------------------------------------------------------------------------------
    def create(self, sid: str, limits: Limits, base: str | None = None, snapshot: SnapshotInfo | None = None,
               env: dict[str, str] | None = None) -> dict:
        ok, why = self.available()
        if not ok:
            raise Unavailable(why)
        if snapshot is None and base not in (None, "", "default"):
            raise BadRequest(f"the vm tier has one base image, 'default' (got {base!r})")
        t0 = time.monotonic()
        if snapshot is not None:
            m = snapshot.meta or {}
            mem, sdisk = Path(m.get("mem", "")), Path(m.get("disk", ""))
            if not mem.is_file() or not sdisk.is_file():
                raise NotFound(f"snapshot {snapshot.snapshot_id}: its memory or disk file is gone")
            vm = self._new_vm(sid, limits, network=m.get("network"), memory_mb=m.get("memory_mb"),
                              smp=m.get("smp"), env={**(m.get("env") or {}), **(env or {})})
            try:
                if m.get("kernel") and Path(m["kernel"]).exists():
                    vm.info["kernel"], vm.info["initrd"] = m["kernel"], m.get("initrd", vm.info["initrd"])
                for k in ("tsc_khz", "accel", "cpu"):  # the restoring QEMU must look like the saving one
                    if m.get(k):
                        vm.info[k] = m[k]
                vm.info["disk"] = None
                self._restore_into(vm, mem, sdisk)
                vm.info["last_snapshot"] = {"id": snapshot.snapshot_id, "mem": str(mem), "disk": str(sdisk)}
                vm.qmp_cmd("cont")
                vm.agent.wait_ready(BOOT_TIMEOUT_S, vm.alive, vm.dir / "console.log")
            except BaseException:
                self.kill(sid)
                raise
            kind = "restore"
        else:
            vm = self._new_vm(sid, limits, env=env)
            try:
                base_img = (self.art / "base.qcow2").resolve()
                disk = vm.dir / "disk-0.qcow2"
                self._create_overlay(disk, base_img)
                vm.info["disk"] = str(disk)
                self._spawn(vm, disk, incoming=None)
                vm.agent.wait_ready(BOOT_TIMEOUT_S, vm.alive, vm.dir / "console.log")
            except BaseException:
                self.kill(sid)
                raise
            kind = "boot"
        vm.info["paused"] = False
        vm.save()
        log.info("vm %s: %s in %.2f s", sid, kind, time.monotonic() - t0)
        return self._meta(vm)

    def _meta(self, vm: _VM) -> dict:
        i = vm.info
        return {"dir": str(vm.dir), "pid": i["pid"], "memory_mb": i["memory_mb"], "smp": i["smp"],
                "network": i["network"], "disk": i["disk"], "qmp_sock": i["qmp_sock"],
                "agent_sock": i["agent_sock"]}

    def kill(self, sid: str) -> None:
        d = self._sb_dir(sid)
        with self._lock:
            vm = self._vms.pop(sid, None)
        if vm is None and (d / "vm.json").exists():
            with contextlib.suppress(OSError, ValueError):
                vm = _VM(sid, d, json.loads((d / "vm.json").read_text()))
        if vm is not None:
            with vm.lock:
                self._stop_qemu(vm)
                sd = vm.info.get("sock_dir")
                if sd and Path(sd) != d:
                    shutil.rmtree(sd, ignore_errors=True)
        if d.exists():
            shutil.rmtree(d, ignore_errors=True)
        self._gc_snapshots()

    def _stop_qemu(self, vm: _VM) -> None:
        """quit over QMP, SIGKILL to QEMU's process group if that does not end it within 3 s."""
        pid = vm.pid
        if pid and vm.alive():
            with contextlib.suppress(Exception):
                if vm.qmp is None:
                    vm.qmp = QMP(vm.info["qmp_sock"], timeout=2)
                vm.qmp.execute("quit", timeout=2)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and vm.alive():
                time.sleep(0.02)
            if vm.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and vm.alive():
                    time.sleep(0.02)
        vm.close_conns()
        if vm.proc is not None:
            with contextlib.suppress(Exception):
                vm.proc.wait(timeout=10)

    def pause(self, sid: str) -> None:
        self._set_paused(sid, True)

    def resume(self, sid: str) -> None:
        self._set_paused(sid, False)

    def _set_paused(self, sid: str, paused: bool) -> None:
        """Stop (pause) or continue (resume) the guest's vCPUs through QMP and record it."""
        vm = self._get(sid)
        with vm.lock:
            vm.qmp_cmd("stop" if paused else "cont")
            vm.info["paused"] = paused
            vm.save()

    def checkpoint(self, sid: str, snapshot_id: str, parent: SnapshotInfo | None) -> dict:
        vm = self._get(sid)
        sd = self._snap_dir(snapshot_id)
        if sd.exists():
            raise SandboxError(f"snapshot dir {sd} already exists")
        with vm.lock, vm.agent.lock:  # no agent request in flight while the state is sealed
            t0 = time.monotonic()
            st = vm.qmp_cmd("query-status")
            was_running = bool(st.get("running"))
            if st.get("status") == "postmigrate":
                # paused since an earlier checkpoint: its images are handed over ("inactive") until QEMU
                # runs again; a blink of cont/stop takes them back so the disk can be sealed again
                vm.qmp_cmd("cont")
                vm.qmp_cmd("stop")
            elif was_running:
                vm.qmp_cmd("stop")
            sd.mkdir(parents=True)
            try:
                # 1. seal the disk: the active overlay becomes the snapshot's layer, the VM continues on a new one
                old_n = vm.info["disk_n"]
                old_disk = Path(vm.info["disk"])
                snap_disk = sd / "disk.qcow2"
                os.link(old_disk, snap_disk)
                new_n = old_n + 1
                new_disk = vm.dir / f"disk-{new_n}.qcow2"
                self._create_overlay(new_disk, snap_disk)
                vm.qmp_cmd("blockdev-add", {"driver": "qcow2", "node-name": f"disk{new_n}", "backing": None,
                                            "file": {"driver": "file", "filename": str(new_disk),
                                                     "node-name": f"file{new_n}", "discard": "unmap"}})
                vm.qmp_cmd("blockdev-snapshot", {"node": f"disk{old_n}", "overlay": f"disk{new_n}"})
                vm.info["disk_n"], vm.info["disk"] = new_n, str(new_disk)
                vm.save()
                t_disk = time.monotonic()
                # 2. memory + device state, written by QEMU straight into a file we hand it (fd: migration)
                mem = sd / "mem"
                tmp = sd / "mem.tmp"
                vm.qmp_cmd("migrate-set-parameters", {"max-bandwidth": 1 << 40})
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    vm.qmp_cmd("getfd", {"fdname": "k3mig"}, fds=[fd])
                finally:
                    os.close(fd)
                vm.qmp_cmd("migrate", {"uri": "fd:k3mig"})
                deadline = time.monotonic() + 600
                while True:
                    m = vm.qmp_cmd("query-migrate")
                    s = m.get("status")
                    if s == "completed":
                        break
                    if s in ("failed", "cancelled") or time.monotonic() > deadline:
                        raise SandboxError(f"memory snapshot failed: {m.get('error-desc', s)}")
                    time.sleep(0.005)
                self._wait_closed(vm, tmp)  # QEMU flushes and closes the file in its cleanup, just after
                os.replace(tmp, mem)
                t_mem = time.monotonic()
            except BaseException:
                shutil.rmtree(sd, ignore_errors=True)
                if was_running:
                    with contextlib.suppress(Exception):
                        vm.qmp_cmd("cont")
                raise
            if was_running:
                vm.qmp_cmd("cont")
            t_end = time.monotonic()
            meta = {"mem": str(mem), "disk": str(snap_disk), "memory_mb": vm.info["memory_mb"],
                    "smp": vm.info["smp"], "network": vm.info["network"], "kernel": vm.info["kernel"],
                    "initrd": vm.info["initrd"], "tsc_khz": vm.info["tsc_khz"], "accel": vm.info.get("accel"),
                    "cpu": vm.info.get("cpu"), "env": vm.info.get("env") or {},
                    "disk_parent": qcow2_backing(snap_disk), "mem_bytes": mem.stat().st_size,
                    "timing_s": {"disk": round(t_disk - t0, 3), "mem": round(t_mem - t_disk, 3),
                                 "total": round(t_end - t0, 3)}}
            atomic_write_json(sd / "meta.json", {"snapshot_id": snapshot_id, "sandbox_id": sid, **meta})
            vm.info["last_snapshot"] = {"id": snapshot_id, "mem": str(mem), "disk": str(snap_disk)}
            vm.save()
            return meta

    @staticmethod
    def _wait_closed(vm: _VM, path: Path, timeout: float = 60) -> None:
        """Wait until QEMU no longer has `path` open."""
        fd_dir = Path(f"/proc/{vm.pid}/fd")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                links = [os.readlink(f) for f in fd_dir.iterdir()]
            except OSError:
                return  # QEMU is gone
            if str(path) not in links:
                return
            time.sleep(0.005)
        raise SandboxError(f"QEMU did not close {path}")

    def delete_snapshot(self, snap: SnapshotInfo) -> None:
        sd = self._snap_dir(snap.snapshot_id)
        if not sd.exists():
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sd / "mem")
        (sd / "deleted").touch()
        self._gc_snapshots()

    def _gc_snapshots(self) -> None:
        """Remove deleted snapshot dirs whose disk no live qcow2 (sandbox or kept snapshot) builds on."""
        with self._lock:
            dead = [d for d in self.snap_root.iterdir() if (d / "deleted").exists()] if self.snap_root.exists() else []
            if not dead:
                return
            refs: set[str] = set()
            for p in list(self.sb_root.glob("*/disk-*.qcow2")) + list(self.snap_root.glob("*/disk.qcow2")):
                if p.parent in dead:
                    continue
                b = qcow2_backing(p)
                if b:
                    refs.add(os.path.normpath(b))
            progressed = True
            while progressed:  # a freed layer may free its parent
                progressed = False
                for d in list(dead):
                    if os.path.normpath(str(d / "disk.qcow2")) in refs:
                        continue
                    b = qcow2_backing(d / "disk.qcow2")
                    shutil.rmtree(d, ignore_errors=True)
                    dead.remove(d)
                    if b:
                        nb = os.path.normpath(b)
                        still = any(qcow2_backing(x) and os.path.normpath(qcow2_backing(x)) == nb
                                    for x in list(self.sb_root.glob("*/disk-*.qcow2"))
                                    + list(self.snap_root.glob("*/disk.qcow2")))
                        if not still:
                            refs.discard(nb)
                            progressed = True

    def recover(self, sid: str, meta: dict, state: State) -> None:
        d = self._sb_dir(sid)
        try:
            info = json.loads((d / "vm.json").read_text())
        except (OSError, ValueError) as e:
            raise SandboxError(f"vm sandbox {sid}: no usable vm.json in {d} ({e})") from e
        with self._lock:
            old = self._vms.get(sid)
        if old is not None:
            old.close_conns()
        vm = _VM(sid, d, info)
        with vm.lock:
            if vm.alive():
                try:
                    vm.qmp_cmd("query-status")
                except SandboxError as e:
                    raise SandboxError(f"vm sandbox {sid}: QEMU (pid {vm.pid}) is alive but QMP fails: {e}") from e
            else:
                last = info.get("last_snapshot")
                if not last or not Path(last.get("mem", "")).is_file() or not Path(last.get("disk", "")).is_file():
                    raise SandboxError(f"vm sandbox {sid}: its QEMU is gone and it has no checkpoint to restore")
                log.warning("vm %s: QEMU gone; restoring from its last checkpoint %s", sid, last.get("id"))
                sd = vm.info.get("sock_dir")
                if sd:
                    Path(sd).mkdir(parents=True, exist_ok=True)
                self._restore_into(vm, Path(last["mem"]), Path(last["disk"]))
            if state == State.PAUSED:
                vm.qmp_cmd("stop")
                vm.info["paused"] = True
            else:
                vm.qmp_cmd("cont")
                vm.info["paused"] = False
            vm.save()
        with self._lock:
            self._vms[sid] = vm

    # ---- work --------------------------------------------------------------------------------------
    @staticmethod
    def _check_path(path: str) -> str:
        if not isinstance(path, str) or not path:
            raise BadRequest("path must be a non-empty string")
        if "\0" in path:
            raise BadRequest("path contains a NUL byte")
        if not path.startswith("/"):
            raise BadRequest(f"path must be absolute: {path!r}")
        return posixpath.normpath(path) if path != "/" else "/"

    @staticmethod
    def _raise_agent_error(r: dict, what: str) -> None:
        kind = r.get("kind")
        msg = _unb64(r.get("error")).decode(errors="replace") or kind or "error"
        cls = {"notfound": NotFound, "isdir": BadRequest, "notdir": BadRequest, "toolarge": TooLarge,
               "badreq": BadRequest}.get(kind, SandboxError)
        raise cls(f"{what}: {msg}")

    def exec(self, sid: str, cmd: str | list[str], timeout: float = 60.0, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | None = None) -> ExecResult:
        vm = self._running_vm(sid)
        argv = command_argv(cmd)
        full_env = {"PATH": DEFAULT_PATH, "HOME": "/root", **(vm.info.get("env") or {}), **(env or {})}
        for k, v in full_env.items():
            if not isinstance(k, str) or not isinstance(v, str) or not _ENV_NAME.match(k) or "\0" in v:
                raise BadRequest(f"bad environment variable {k!r}")
        cwd = self._check_path(cwd) if cwd is not None else DEFAULT_CWD
        if timeout is None or timeout <= 0:
            raise BadRequest("timeout must be positive")
        # the agent runs `script` with sh -c in a new session: cd, a clean environment, then the command
        # (a string is the sh -c script itself; argv is exec'd: a missing binary gives sh's 127)
        lines = [f"cd {shlex.quote(cwd)} || exit 1"]
        if all(re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k) for k in full_env):
            lines += [f"export {k}={shlex.quote(v)}" for k, v in full_env.items()]
            envcmd = ""
        else:  # names sh cannot export: env(1) sets them
            envcmd = "env -i " + " ".join(shlex.quote(f"{k}={v}") for k, v in full_env.items()) + " "
        if isinstance(cmd, str) and not envcmd:
            lines.append(cmd)
        else:
            if envcmd and "=" in argv[0]:
                raise BadRequest("a program name with '=' cannot be combined with these environment names")
            lines.append(f"exec {envcmd}{' '.join(shlex.quote(a) for a in argv)}")
        script = "\n".join(lines) + "\n"
        if "\0" in script:
            raise BadRequest("cmd, env or cwd contains a NUL byte")
        data = bytes(stdin or b"")
        t0 = time.monotonic()
        with vm.lock:
            if vm.info.get("paused"):
                raise InvalidState(f"sandbox {sid} is paused")
            sb = script.encode()
            r = vm.agent.request("exec", {"timeout": f"{float(timeout):.3f}", "script_len": len(sb),
                                          "stdin_len": len(data), "max_out": MAX_OUTPUT_BYTES},
                                 payload=sb + (b"\0" if len(sb) <= SCRIPT_INLINE_MAX else b"") + data,
                                 timeout=float(timeout) + 120.0 + len(data) / 1e6,
                                 probe_after=float(timeout) + 5.0,
                                 raw=("out", "err"))
        if not r.get("ok"):
            self._raise_agent_error(r, "exec")
        out, err = r["raw"]["out"], r["raw"]["err"]
        notes = []
        if len(out) > MAX_OUTPUT_BYTES:
            out, _ = out[:MAX_OUTPUT_BYTES], notes.append(f"[k3: stdout truncated to {MAX_OUTPUT_BYTES} bytes]")
        if len(err) > MAX_OUTPUT_BYTES:
            err, _ = err[:MAX_OUTPUT_BYTES], notes.append(f"[k3: stderr truncated to {MAX_OUTPUT_BYTES} bytes]")
        stderr = err.decode(errors="replace") + "".join("\n" + n for n in notes)
        return ExecResult(stdout=out.decode(errors="replace"), stderr=stderr, exit_code=int(r.get("exit_code", -1)),
                          timed_out=bool(r.get("timed_out")), duration_s=round(time.monotonic() - t0, 4))

    def read_file(self, sid: str, path: str) -> bytes:
        path = self._check_path(path)
        vm = self._running_vm(sid)
        with vm.lock:
            r = vm.agent.request("read", {"path": _b64(path), "max": MAX_FILE_BYTES}, timeout=300, raw=("size",),
                                 probe_after=30.0)
        if not r.get("ok"):
            self._raise_agent_error(r, f"read {path}")
        data = r["raw"]["size"]
        if len(data) > MAX_FILE_BYTES:
            raise TooLarge(f"read {path}: the file exceeds {MAX_FILE_BYTES} bytes")
        return data

    def write_file(self, sid: str, path: str, data: bytes, mode: int = 0o644) -> None:
        path = self._check_path(path)
        if path == "/":
            raise BadRequest("cannot write to /")
        data = bytes(data)
        if len(data) > MAX_FILE_BYTES:
            raise TooLarge(f"file of {len(data)} bytes exceeds {MAX_FILE_BYTES}")
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise BadRequest(f"bad mode {mode!r}")
        vm = self._running_vm(sid)
        with vm.lock:
            r = vm.agent.request("write", {"path": _b64(path), "mode": format(mode, "o"), "len": len(data)},
                                 payload=data, timeout=300, probe_after=30.0 + len(data) / 1e6)
        if not r.get("ok"):
            self._raise_agent_error(r, f"write {path}")

    def list_files(self, sid: str, path: str) -> list[FileInfo]:
        path = self._check_path(path)
        vm = self._running_vm(sid)
        with vm.lock:
            r = vm.agent.request("list", {"path": _b64(path)}, timeout=120, probe_after=30.0)
        if not r.get("ok"):
            self._raise_agent_error(r, f"list {path}")
        names = [n for n in _unb64(r.get("names")).split(b"\0") if n]
        text = _unb64(r.get("stat"))
        out: list[FileInfo] = []
        pos = 0
        rx = re.compile(rb"(\d+) ([0-9a-fA-F]+) ")
        for n in names:
            m = rx.match(text, pos)
            if not m or not text.startswith(n + b"\n", m.end()):
                continue  # vanished between listing and stat
            pos = m.end() + len(n) + 1
            name = n[2:].decode(errors="surrogateescape") if n.startswith(b"./") else n.decode(errors="replace")
            is_dir = (int(m.group(2), 16) & 0o170000) == 0o040000
            out.append(FileInfo(name=name, path=posixpath.join(path, name), is_dir=is_dir,
                                size=0 if is_dir else int(m.group(1))))
        return sorted(out, key=lambda f: f.name)

