"""The sandbox's init (pid 1 inside), run by the host's interpreter as
`python -I -S <this file> <dir of _fs.py> <status fd> <control fd>` under `unshare` (see the package docstring).

It is spawned ahead (a warm pool): it imports everything, says "p <host pid>" on the status fd and waits for its
config on the control socket (SOCK_SEQPACKET; sent once the tier has moved it and its unshare parent into the
sandbox's cgroups; EOF: exit). Then it enters a cgroup namespace rooted there, sets up the root (overlay, binds,
/dev, /proc, pivot_root), says "ok" (or "err <message>"), waits for "g" (the tier has written the uid/gid maps),
forbids further cgroup namespaces, says "ready", and serves exec requests and reaps orphans until the control
socket reaches EOF (the tier closed it or died). Nothing here imports k3: only the stdlib and `_fs`, all before
pivot_root. Its argv holds no config, only where `_fs` is and two fd numbers.
"""

import _signal
import _socket
import marshal
import os
import resource
import select
import struct
import sys

_fs = None  # k3/env/_fs.py, imported by main() from the directory given on the command line

DEV_NODES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0))
DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
             ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx"))
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")  # like Docker
PROC_MASKED = ("kcore", "keys", "timer_list", "sched_debug", "latency_stats", "kmsg", "acpi", "scsi")


def setup_root(c: dict) -> int:
    """Mount the sandbox root described by config `c` and pivot into it; returns an O_PATH fd of the host's
    /proc/sys/user (needed once the user namespace exists)."""
    _fs.unshare(_fs.CLONE_NEWCGROUP)  # rooted at the sandbox's cgroups, which we are in by now
    os.umask(0)
    _fs.set_dumpable(False)  # sandbox processes may not ptrace or inspect /proc/1/*
    _fs.mount(None, "/", None, _fs.MS_REC | _fs.MS_PRIVATE)
    os.chdir(c["cwd"])  # overlay paths are relative to the state dir: /proc/mounts inside shows no host paths
    _fs.mount_overlay(c["root"], c["lowers"], c["upper"], c["work"], c["options"])
    root = os.open(c["root"], os.O_PATH | os.O_DIRECTORY)
    nosym = _fs.RESOLVE_NO_SYMLINKS

    def mkdir(p, mode=0o755):  # mount point inside the root; refuses symlinks (the sandbox may plant them)
        return _fs.makedirs_in_root(root, p, mode, nosym)

    def reopen(p):  # the root of what was just mounted on p
        return _fs.open_in_root(root, p, os.O_PATH | os.O_DIRECTORY, resolve=nosym)

    for src, dst in c["binds"]:
        s = os.open(src, os.O_PATH | os.O_DIRECTORY)
        try:
            d = mkdir(dst)
        except OSError:
            os.close(s)
            continue  # mount point replaced by a symlink or file inside the sandbox: skip
        _fs.bind_ro(s, d)
        os.close(s)
        os.close(d)
    d = mkdir("/dev")
    _fs.mount("tmpfs", _fs.fd_path(d), "tmpfs", _fs.MS_NOSUID | _fs.MS_NOEXEC, "mode=755,size=65536k")
    os.close(d)
    d = reopen("/dev")
    for name, major, minor in DEV_NODES:
        os.mknod(name, 0o20666, os.makedev(major, minor), dir_fd=d)
    for name, target in DEV_LINKS:
        os.symlink(target, name, dir_fd=d)
    for name, fs, flags, data in (
            ("pts", "devpts", _fs.MS_NOSUID | _fs.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"),
            ("shm", "tmpfs", _fs.MS_NOSUID | _fs.MS_NODEV, "mode=1777,size=" + c["shm"])):
        os.mkdir(name, 0o755, dir_fd=d)
        f = os.open(name, os.O_PATH | os.O_DIRECTORY, dir_fd=d)
        _fs.mount(fs, _fs.fd_path(f), fs, flags, data)
        os.close(f)
    null = os.open("null", os.O_PATH, dir_fd=d)
    p = mkdir("/proc", 0o555)
    _fs.mount("proc", _fs.fd_path(p), "proc", _fs.MS_NOSUID | _fs.MS_NODEV | _fs.MS_NOEXEC)
    os.close(p)
    p = reopen("/proc")
    for name in PROC_READ_ONLY:
        try:
            f = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=p)
        except FileNotFoundError:
            continue
        _fs.bind_ro(f, f)
        os.close(f)
    for name in PROC_MASKED:
        try:
            f = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=p)
        except FileNotFoundError:
            continue
        if os.path.isdir(_fs.fd_path(f)):
            _fs.mount("tmpfs", _fs.fd_path(f), "tmpfs", _fs.MS_RDONLY, "size=0")
        else:
            _fs.mount(_fs.fd_path(null), _fs.fd_path(f), None, _fs.MS_BIND)
        os.close(f)
    for fd in (null, d, p):
        os.close(fd)
    sysctl_user = os.open("/proc/sys/user", os.O_PATH | os.O_DIRECTORY)  # the host's (writable) /proc
    os.fchdir(root)
    _fs.pivot_root(".", ".")
    _fs.umount2(".", _fs.MNT_DETACH)
    os.chdir("/")
    os.close(root)
    _fs.sethostname(c["hostname"])
    if c["netns"]:
        _fs.link_up("lo")
    return sysctl_user


def kill_session(sid: int) -> None:
    """SIGKILL the exec's process group and anything else still in its session."""
    try:
        os.killpg(sid, 9)
    except OSError:
        pass
    for p in os.listdir("/proc"):
        if p.isdigit() and p != "1":
            try:
                with open("/proc/%s/stat" % p, "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[3]) == sid:
                        os.kill(int(p), 9)
            except (OSError, ValueError, IndexError):
                pass


def recv_exact(s, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


class Server:
    """The exec loop: requests arrive on the control socket with 4 fds (stdin, stdout, stderr, a status socket);
    each command is forked into its own session; its wait status goes back on its status socket ("x <status>")."""

    def __init__(self, ctl):
        self.ctl = ctl
        self.execs, self.socks = {}, {}  # exec pid -> status socket (None once the tier hung up); fd -> (socket, pid)
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        _signal.signal(17, lambda *a: None)  # SIGCHLD -> a byte on wake_w
        _signal.set_wakeup_fd(wake_w)
        self.poller = select.poll()
        self.poller.register(ctl.fileno(), select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)

    def spawn(self, s, fds) -> None:
        """Request on s: u64 length + marshal {argv, env, cwd}; fds: stdin, stdout, stderr."""
        req = marshal.loads(recv_exact(s, struct.unpack("Q", recv_exact(s, 8))[0]))
        argv = req["argv"]
        pid = os.fork()
        if pid == 0:
            try:
                _signal.set_wakeup_fd(-1)
                os.setsid()
                for i, fd in enumerate(fds):
                    os.dup2(fd, i)
                os.closerange(3, 1 << 20)
                os.umask(0o022)
                os.setgroups([])
                os.setresgid(0, 0, 0)
                os.setresuid(0, 0, 0)
                fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)  # the init is -1000; commands are not
                os.write(fd, b"0")
                os.close(fd)
                if req.get("fsize"):  # largest file the command may write (SIGXFSZ/EFBIG beyond); root inside
                    resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))  # cannot raise it
                os.chdir(req["cwd"])
                os.execvpe(argv[0], argv, req["env"])
            except OSError as e:
                os.write(2, ("%s: %s\n" % (argv[0], e.strerror)).encode(errors="replace"))
                os._exit(127 if e.errno in (2, 20) else 126)  # ENOENT/ENOTDIR: not found
            finally:
                os._exit(127)
        self.execs[pid], self.socks[s.fileno()] = s, (s, pid)
        self.poller.register(s.fileno(), select.POLLIN)

    def reap(self) -> None:
        try:
            os.read(self.wake_r, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            s = self.execs.pop(pid, None)  # anything else is an orphan we adopted
            if s is not None:
                self.poller.unregister(s.fileno())
                del self.socks[s.fileno()]
                try:
                    s.sendall(b"x %d\n" % status)
                except OSError:
                    pass
                s.close()

    def on_status_socket(self, fd: int) -> None:
        s, pid = self.socks[fd]
        try:
            data = s.recv(64)
        except OSError:
            data = b""
        if data[:1] == b"k" or not data:  # timeout, or the tier gave up on this exec
            kill_session(pid)
        if not data:
            self.poller.unregister(fd)
            del self.socks[fd]
            self.execs[pid] = None
            s.close()

    def on_control(self) -> bool:
        """One exec request; False at EOF (the tier closed the socket or died)."""
        try:
            msg, anc, _, _ = self.ctl.recvmsg(16, _socket.CMSG_SPACE(4 * 4))
        except OSError:
            return False
        if not msg:
            return False
        fds = []
        for level, kind, data in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds += struct.unpack("%di" % (len(data) // 4), data[:len(data) // 4 * 4])
        if len(fds) != 4:
            for fd in fds:
                os.close(fd)
            return True
        s = _socket.socket(fileno=fds[3])
        try:
            self.spawn(s, fds[:3])
        except Exception as e:
            try:
                s.sendall(b"e %s\n" % str(e).encode(errors="replace"))
            except OSError:
                pass
            s.close()
        finally:
            for fd in fds[:3]:
                os.close(fd)
        return True

    def run(self) -> None:
        while True:
            ready = {fd for fd, _ in self.poller.poll()}
            if self.wake_r in ready:
                self.reap()
            for fd in ready & self.socks.keys():
                self.on_status_socket(fd)
            if self.ctl.fileno() in ready and not self.on_control():
                return


def main(argv: list[str]) -> None:
    global _fs
    env_dir, status_fd, ctl_fd = argv[1], int(argv[2]), int(argv[3])
    sys.path.insert(0, env_dir)
    import _fs as fs_module  # noqa: PLC0415 - from the directory given on the command line
    _fs = fs_module
    ctl = _socket.socket(fileno=ctl_fd)  # SOCK_SEQPACKET to the tier

    def say(msg: str) -> None:
        os.write(status_fd, (msg.replace("\n", " ") + "\n").encode())

    say("p %d" % int(os.readlink("/proc/self")))  # /proc is still the host's: our host pid
    try:
        msg, anc, _, _ = ctl.recvmsg(1 << 20, _socket.CMSG_SPACE(4))  # config + the fd of init.log
    except OSError:
        os._exit(1)
    if not msg or len(anc) != 1 or anc[0][:2] != (_socket.SOL_SOCKET, _socket.SCM_RIGHTS):
        os._exit(0)  # EOF: the tier closed the pool or died
    try:
        log = struct.unpack("i", anc[0][2][:4])[0]
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        sysctl_user = setup_root(marshal.loads(msg))
        _fs.unshare(_fs.CLONE_NEWUSER)  # the tier writes the identity uid/gid map, then says go
        say("ok")
        if ctl.recv(1) != b"g":  # from now on: exec requests; EOF = exit
            os._exit(1)
        # No cgroup namespaces below ours: with one, sandbox root could mount its own cgroup dirs and lift its
        # limits. The sysctl is per user namespace (looked up in ours now) and /proc/sys is read-only inside.
        fd = os.open("max_cgroup_namespaces", os.O_WRONLY, dir_fd=sysctl_user)
        os.write(fd, b"0")
        os.close(fd)
        os.close(sysctl_user)
        say("ready")
    except BaseException as e:
        say("err %s: %s" % (type(e).__name__, e))
        os._exit(1)
    os.close(status_fd)
    Server(ctl).run()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
