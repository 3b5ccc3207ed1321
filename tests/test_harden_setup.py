"""Issue 17 item 9: `scripts/setup.sh` (run by `make test` and `make demo`) never fails because the system package
step failed (a busy apt lock): it retries, then warns and exits 0, with CI set or not. Run against stubs: a fake
.venv python, `id`, `apt-get` and a scripts/setup_vm.sh that fails or succeeds as told."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _exe(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def tree(tmp_path):
    t = tmp_path / "repo"
    shutil.copy(ROOT / "scripts" / "setup.sh", (t / "scripts").mkdir(parents=True) or t / "scripts" / "setup.sh")
    _exe(t / ".venv" / "bin" / "python", "exit 0\n")  # pip and `import torch` succeed
    (t / ".venv" / "bin" / "activate").write_text(f'PATH="{t / ".venv" / "bin"}:$PATH"\n')
    _exe(t / "fakebin" / "id", '[ "$1" = -u ] && echo 0 || /usr/bin/id "$@"\n')  # root
    _exe(t / "fakebin" / "apt-get", "exit 0\n")
    return t


def _run(t: Path, vm_rc: int, **env):
    log = t / "vm.log"
    _exe(t / "scripts" / "setup_vm.sh", f'echo attempt >> "{log}"\necho "E: Could not get lock" >&2\nexit {vm_rc}\n')
    e = {k: v for k, v in os.environ.items() if k not in ("CI", "K3_SETUP_VM", "K3_VM_DIR")}
    e.update(PATH=f"{t / 'fakebin'}:{os.environ['PATH']}", HOME=str(t / "home"), K3_SETUP_VM_WAIT="0", **env)
    p = subprocess.run(["bash", str(t / "scripts" / "setup.sh")], env=e, capture_output=True, text=True, timeout=60)
    attempts = len(log.read_text().splitlines()) if log.exists() else 0
    return p, attempts


@pytest.mark.parametrize("ci", [None, "true"])
def test_failing_vm_setup_retries_then_warns_and_succeeds(tree, ci):
    p, attempts = _run(tree, 100, **({"CI": ci} if ci else {}))
    assert p.returncode == 0, p.stderr
    assert attempts == 3 and "retrying" in p.stderr and "VM sandbox tier is unavailable" in p.stderr
    assert "make setup-vm" in p.stderr


def test_working_vm_setup_runs_once_and_can_be_skipped(tree):
    p, attempts = _run(tree, 0)
    assert p.returncode == 0 and attempts == 1 and "warning" not in p.stderr
    p, attempts = _run(tree, 100, K3_SETUP_VM="0")
    assert p.returncode == 0 and attempts == 1  # (the log is from the previous run: no new attempt)


def test_makefile_has_the_explicit_system_step():
    text = (ROOT / "Makefile").read_text()
    assert "setup-vm:" in text and "scripts/setup_vm.sh" in text
