"""Running a coding task's hidden asserts inside a sandbox and turning the outcome into a `Reward`.

The harness script runs `/work/solution.py` as module `solution` (compiled from its source, so no stale
bytecode cache can stand in for it) in a fresh `python3`, runs each assert in its own namespace
(a copy of the module's), and prints one result line tagged with a nonce it read from stdin *before*
importing the solution, so a solution that prints or exits early does not pass. (It is not hardened against
code that deliberately inspects the harness's frames.) The host compiles every hidden test first: a test that
does not compile, or a sandbox without python3, is the task's fault (`TaskError`); anything the solution does
(a syntax error, an exception, a timeout, a failed assert) is reward 0.
"""

from __future__ import annotations

import json
import secrets

from .base import WORKDIR, Reward, TaskError

HARNESS_PATH = "/tmp/k3_hidden/run_tests.py"   # outside the workspace the tools can reach
_TAG = "K3-HIDDEN-RESULT"

_SCRIPT = """import json, sys, types
def _main(tests):
    nonce = sys.stdin.readline().strip()
    sys.path.insert(0, {workdir!r})
    solution = types.ModuleType("solution")
    solution.__file__ = {path!r}
    sys.modules["solution"] = solution
    try:   # compiled from source: never a stale __pycache__ entry
        with open({path!r}, encoding="utf-8") as f:
            src = f.read()
        exec(compile(src, {path!r}, "exec"), solution.__dict__)
    except BaseException as e:
        print({tag!r}, nonce, json.dumps({{"import_error": type(e).__name__ + ": " + str(e)[:300]}}), flush=True)
        return
    failed = []
    for i, src in enumerate(tests):
        try:
            exec(compile(src, "<hidden test %d>" % i, "exec"), dict(vars(solution)))
        except BaseException as e:
            failed.append("%s: %s: %s" % (src[:120], type(e).__name__, str(e)[:200]))
    print({tag!r}, nonce, json.dumps({{"passed": len(tests) - len(failed), "failed": failed}}), flush=True)
_main({tests!r})
"""


def harness_source(tests: list[str], solution_path: str = f"{WORKDIR}/solution.py") -> str:
    return _SCRIPT.format(workdir=WORKDIR, path=solution_path, tag=_TAG, tests=list(tests))


def run_hidden_tests(sandbox, tests: list[str], task_id: str = "?", timeout: float = 10.0,
                     solution_path: str = f"{WORKDIR}/solution.py") -> Reward:
    """Reward 1 iff every assert in `tests` passes against `solution_path` in `sandbox`."""
    for i, src in enumerate(tests):
        if not isinstance(src, str):
            raise TaskError(f"task {task_id}: hidden test {i} is {type(src).__name__}, expected Python source text")
        try:
            compile(src, f"<hidden test {i}>", "exec")
        except SyntaxError as e:
            raise TaskError(f"task {task_id}: hidden test {i} cannot run, it does not compile: {e.msg} "
                            f"({src[:80]!r})") from e
    sandbox.write_file(HARNESS_PATH, harness_source(tests, solution_path).encode())
    nonce = secrets.token_hex(16)
    r = sandbox.exec(["python3", "-B", HARNESS_PATH], timeout=timeout, cwd=WORKDIR, stdin=(nonce + "\n").encode(),
                     env={"PYTHONDONTWRITEBYTECODE": "1"})
    if r.timed_out:
        return Reward(0.0, f"hidden tests timed out after {timeout:g} s")
    if r.exit_code == 127 or "python3: not found" in r.stderr or "No such file or directory: 'python3'" in r.stderr:
        raise TaskError(f"task {task_id}: the sandbox has no python3 to run the hidden tests "
                        f"({r.stderr.strip()[:200]})")
    result = None
    for line in r.stdout.splitlines():
        head, _, rest = line.partition(" ")
        if head == _TAG and rest.startswith(nonce + " "):
            result = json.loads(rest[len(nonce) + 1:])
    if result is None:
        return Reward(0.0, f"the hidden tests did not finish (exit code {r.exit_code}; {r.stderr.strip()[-300:]!r})")
    if "import_error" in result:
        return Reward(0.0, f"solution.py does not import: {result['import_error']}")
    if result["failed"]:
        return Reward(0.0, f"{result['passed']}/{len(tests)} hidden tests pass; first failure: {result['failed'][0]}")
    return Reward(1.0, f"all {len(tests)} hidden tests pass")
