"""The "vm" tier: one QEMU microvm per sandbox (TCG unless a usable KVM exists), with full memory snapshots.

Guest (built by scripts/setup_vm.sh into $K3_VM_DIR, default ~/.cache/k3/vm):
- the Debian cloud kernel: `vmlinux` (uncompressed ELF, booted through PVH; ~1 s faster), else `vmlinuz`;
- a BusyBox initramfs whose /init loads the virtio-mmio modules, mounts the root disk and switch_roots into
  BusyBox init, which runs /k3/rc and respawns /k3/agent (sources: k3/env/guest/);
- the default root disk `base.qcow2` (→ `base-<stamp>.qcow2`): ext4 with BusyBox, /k3 and the sandbox's files.

Machine: `-machine microvm -cpu qemu64` (faster than `max` under TCG), RAM = limits.memory_mb (≥ 256), vCPUs
= round(limits.cpus). microvm needs ACPI for the kernel to find its virtio-mmio devices (the cloud kernel has
no virtio_mmio.device= support), and ACPI there is "hardware reduced": no PIT/HPET for the kernel to
calibrate against, which hangs a TCG boot. The host's TSC frequency is therefore passed as `tsc_early_khz`
(under TCG the guest reads the host TSC) with `tsc=reliable`. Devices: a virtio-blk root disk (qcow2 overlay),
a virtio-serial port "k3.agent" (the exec agent), ttyS0 → `console.log`, QMP on a unix socket. No network
(`-nic none`) unless limits.network: then QEMU user-mode networking (slirp: outbound TCP/UDP, guest 10.0.2.15,
DNS 10.0.2.3, no inbound; note slirp maps 10.0.2.2 to the host's loopback, so host services listening on
127.0.0.1 are reachable from such a guest).

Agent protocol (k3/env/guest/agent, a BusyBox sh script): one JSON line per request and response over the
virtio-serial port, ids echoed back (after a reconnect, stale responses are skipped); string fields the host
sends are base64; bulk payloads (exec script and stdin, uploaded files, downloaded files, stdout/stderr) travel
raw with their lengths in the JSON line, followed by a trailer line that verifies the stream is in step.
exec runs `sh -c` in a new session with a clean environment, killed as a process group on timeout (exit 137).

State on disk (the tier's state_dir):
    sandboxes/<sid>/   vm.json (pid, sockets, disk layer, last snapshot), disk-<n>.qcow2, console.log,
                       qemu.log, qmp.sock, agent.sock (sockets in /tmp/k3vm-<uid>/ if the path is too long)
    snapshots/<id>/    mem (QEMU's migration stream: RAM + device state), disk.qcow2 (the sealed disk layer),
                       meta.json

Checkpoint: QMP `stop`; the active qcow2 overlay is hard-linked as the snapshot's disk and the VM switches to a
new overlay over it (`blockdev-add` + `blockdev-snapshot`; the new overlay's header names the snapshot's path,
so chains never point into a sandbox dir); `migrate` to an fd of `mem` (`getfd` + `fd:`) writes RAM and device
state; `cont` if it was running. Disk layers are incremental (a qcow2 backing chain base ← s1 ← s2 …); the
memory file is a full image each time (zero pages cost nothing: ~60–90 MB for a 256–512 MiB guest).
Restore/fork: a fresh QEMU with the snapshot's machine shape, a new overlay over the snapshot's disk and
`-incoming "exec:cat mem"`, then `cont`: processes continue exactly where they were, in every fork.
delete_snapshot frees the memory file at once and the disk layer once no other layer builds on it.

Recovery after a manager restart: QEMU runs in its own session and outlives the manager; `recover` re-attaches
to its QMP/agent sockets (and stops it: recovered sandboxes come back paused). If the QEMU is gone, the sandbox
is restored from its last checkpoint (changes after it are lost), else SandboxError.

Not enforced inside the guest: limits.pids and limits.file_mb (the root disk is a 4 GiB sparse ext4; file_mb
caps uploads only, in the manager). The base image is fixed ("default"); other bases are refused. A snapshot restores
with the machine shape it was taken with (RAM, vCPUs, NIC, kernel, CPU model), whatever the new limits say.

Environment: K3_VM_DIR (artefacts), K3_VM_ACCEL (default tcg; kvm only where KVM runs a stock guest, which
PVM hosts do not), K3_VM_CPU (default qemu64), K3_VM_APPEND (extra kernel arguments).

Measured on the 2-core dev VM (TCG, 512 MiB guest, medians): boot to a ready agent 3.7 s; exec `echo` 46 ms;
4 KiB write/read 43/28 ms; 64 MiB write/read 2.8/0.6 s; pause/resume ~1 ms; checkpoint 0.10 s running,
0.13 s paused (72 MB memory file); restore 0.38 s; fork of two (checkpoint + 2 restores) 0.8 s; kill 24 ms.

Modules: tier.py (VMTier, one VM's state, QEMU command lines, snapshots), channels.py (QMP and the exec agent).
"""

from .channels import QMP, Agent, AgentError, QMPError
from .tier import (BOOT_TIMEOUT_S, DEFAULT_CWD, DEFAULT_PATH, MIN_MEMORY_MB, QEMU, QEMU_IMG, SETUP_HINT, VMTier,
                   host_tsc_khz, qcow2_backing, vm_dir)

__all__ = ["BOOT_TIMEOUT_S", "DEFAULT_CWD", "DEFAULT_PATH", "MIN_MEMORY_MB", "QEMU", "QEMU_IMG", "QMP", "SETUP_HINT",
           "Agent", "AgentError", "QMPError", "VMTier", "host_tsc_khz", "qcow2_backing", "vm_dir"]
