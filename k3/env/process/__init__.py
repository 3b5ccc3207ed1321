"""Process tier: Linux namespaces + overlayfs + cgroup limits and freezer, v1 or v2 (fast; needs root).

Layout under `state_dir` (bases/, layers/ and sandboxes/ are mode 0700):

    bases/default-<hash>/       the default base, built once (see below)
    bases/<sha256>/             a tarball base, extracted once (device nodes dropped)
    layers/<snapshot_id>/       a sealed, read-only layer (a former upper dir), shared by every sandbox and
                                snapshot that stacks it; .<snapshot_id>.json lists its stack and a
                                .<snapshot_id>.deleted file tombstones it
    sandboxes/<sid>/            upper/, work/, root/ (mount point), run.json (what `recover` needs), init.log

Sandbox = a long-lived *init*: a small Python program (`init.py`, run by the host's interpreter) started by
`unshare --fork --pid --mount --uts --ipc [--net] --kill-child`, spawned ahead (a small pool of warm inits waits,
modules imported, for a sandbox); the tier moves both processes into the sandbox's cgroups, then hands the init
its config, and the init enters a new cgroup namespace rooted there. As host root, in its private mount
namespace, it mounts the root: overlayfs (nodev) with the sealed layers newest first over the base, and the
sandbox's own upper/work; then read-only binds (default base only), a fresh /proc (/proc/sys, /proc/irq,
/proc/bus, /proc/fs, /proc/sysrq-trigger read-only; kcore, keys, timer_list… masked), a tmpfs /dev with
null/zero/full/random/urandom/tty, a devpts instance and /dev/shm (no /sys). It pivot_roots into it, sets the
hostname (the sid), brings `lo` up and finally moves itself into a new user namespace with the identity uid/gid
map (written by the tier), where it forbids further cgroup namespaces (otherwise sandbox root could mount its own
cgroup dirs and lift its limits). So sandbox processes are root with files owned by root, but their capabilities
only count in that user namespace: no mknod, no mounts over the ones set up, no host sysctls, no ptrace or
/proc/1/* of the init (non-dumpable, pid 1). All mounts live only in the init's mount namespace: none appears in
the host's, and they vanish with the init's pid namespace (the init's death kills every sandbox process). Not a
VM: no seccomp or LSM profile, the host kernel is shared.

Default base: a skeleton root (mount points; /bin, /lib… symlinks or binds as on the host; a minimal /etc:
passwd/group with root and nobody, hosts, ld.so and ssl config, alternatives) plus read-only, nodev binds
of the host's /usr and of the running Python's prefix at its own path (so its compiled-in paths work; its
bin/ leads PATH). Nothing else of the host is visible. A base may also be a name under bases/ (a directory or
tarball the operator put there) or a directory or tarball under one of the operator's base roots
($K3_SANDBOX_BASE_ROOTS); any other path is refused (BadRequest), so a request cannot make /etc, /proc/1/root or
another sandbox's files its root (bases.py).

exec: the tier hands the init, over a SEQPACKET socketpair (SCM_RIGHTS), stdin/stdout/stderr pipes and a
per-exec status socket, then argv/env/cwd on that socket; the init forks, setsid()s, chdirs *inside* the
sandbox root and execs, and reports the wait status. No host-side process ever runs with the caller's argv,
env (LD_PRELOAD…) or cwd; the command is in every namespace and cgroup from birth; an exec costs one fork
of the init. A string runs under `/bin/sh -c`; a missing binary gives 127 (126: not executable); death by
signal N gives 128+N (137 for the OOM killer). exec returns when the command exits (background children
that keep its stdout open do not hold it up); output beyond MAX_OUTPUT_BYTES per stream is dropped and
noted at the end of stderr. On timeout the init SIGKILLs the command's session (process group and every
process still in the session) and the result is exit_code 124 (TIMEOUT_EXIT), timed_out=True; a child that
called setsid() itself escapes that and lives on until kill/checkpoint. exec on a paused sandbox raises
InvalidState (it could only block).

File API: on `/proc/<init>/root`, i.e. the view the sandbox has (read-only binds included), every path
resolved by openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) from that root: `..` beyond / is refused
(BadRequest), symlinks resolve inside the sandbox, absolute ones re-rooted. Works while paused. Written
files are root-owned with the given mode; parents are created.

Limits: cgroup v1 dirs `<controller>/k3sbx/<sid>-<state-dir tag>` for freezer, memory (memory.limit and
memsw: no swap), pids, cpu (CFS quota) and cpuacct; or, on a cgroup v2 host (the unified hierarchy, no v1
controllers mounted), one dir `k3sbx/<sid>-<tag>` with memory.max + memory.swap.max 0, pids.max, cpu.max and the
core freezer / cgroup.kill (`cgroups.py`). The init and every exec are in them (what a warm init allocated
before it joined, a few MB, stays charged where it was spawned: neither version moves charges). pids.max is
limits.pids + PIDS_OVERHEAD (the unshare and the init count too). limits.file_mb caps every file: each upload, and
every file a command writes (RLIMIT_FSIZE, which root inside cannot raise: SIGXFSZ / EFBIG beyond); there
is no quota on the upper dir. Network: limits.network False gives a net namespace with only `lo`; True
skips the net namespace, so the sandbox shares the host's network, host loopback and abstract unix sockets
included (connections to host services come from uid 0): only for trusted code.

Checkpoints are filesystem-level (CRIU does not work on the target hosts). `checkpoint` stops every process
of the sandbox (freeze, SIGKILL all, thaw), renames the upper dir to layers/<snapshot_id> (O(1): a
checkpoint holds only what changed since the previous one; whiteouts and opaque/redirect xattrs move with
it) and restarts the init over the longer stack with a fresh upper, frozen again if it was paused. So the
sandbox keeps running, but its processes do not survive a checkpoint (background processes and in-flight
execs are killed), nor a restore, fork or recover. Restores/forks put a fresh upper on the snapshot's
layers, which are shared, never copied. Deleted snapshots are tombstoned; a layer goes once no live snapshot
or sandbox stacks it.

Lifetime: the tier holds the control socket of each init. If the tier's process dies, running inits see
EOF and exit; paused ones stay frozen until `recover` or `kill` (which thaw and kill them). `close()`, also
run when the ProcessTier is garbage collected, kills every sandbox and deletes its files. At interpreter
exit the sandboxes' processes and cgroups are removed but their files kept, so a restarted manager can
`recover` them (paused or running; processes restart) and should `kill` the rest. Warm inits of the pool go
with close(), collection and interpreter exit, and exit on their own when the tier's process dies (EOF on
their control socket). One ProcessTier per state_dir at a time.

Modules: tier.py (ProcessTier, the sandboxes, warm inits, exec plumbing), init.py (the init program), cgroups.py,
bases.py (the default base and the base allow-list).
"""

from .bases import BASE_ROOTS_ENV, allowed_base_path
from .cgroups import (CG2_OPTIONAL, CG2_REQUIRED, CG_OPTIONAL, CG_PARENT, CG_REQUIRED, CGROUP_ROOT,  # noqa: F401
                      _cg_procs, cgroup_mode)
from .tier import (MAX_EXEC_REQUEST, OVERLAY_OPTIONS, PIDS_OVERHEAD, TIMEOUT_EXIT, ProcessTier,  # noqa: F401
                   _proc_start)

__all__ = ["BASE_ROOTS_ENV", "CGROUP_ROOT", "CG2_OPTIONAL", "CG2_REQUIRED", "CG_OPTIONAL", "CG_PARENT", "CG_REQUIRED",
           "MAX_EXEC_REQUEST", "cgroup_mode",
           "OVERLAY_OPTIONS", "PIDS_OVERHEAD", "ProcessTier", "TIMEOUT_EXIT", "allowed_base_path"]
