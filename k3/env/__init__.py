"""Agent sandboxes (AgentENV/E2B-shaped): tiers, the manager, the REST server and the `Sandbox` client.

    from k3.env import Sandbox
    sb = Sandbox.create()                  # in-process; Sandbox.create(url="http://127.0.0.1:8000") for a server
    print(sb.exec("uname -a").stdout)

`k3 sandbox serve` runs the REST server (k3.env.server). The server needs fastapi + uvicorn and the remote
client httpx; the in-process mode needs neither.
"""

from .base import (MAX_FILE_BYTES, MAX_OUTPUT_BYTES, BadRequest, ExecResult, FileInfo, InvalidState, Limits,
                   NotFound, SandboxError, SnapshotInfo, State, Tier, TooLarge, Unavailable)
from .client import AuthError, Sandbox
from .manager import SandboxManager, default_manager, default_state_dir, set_default_manager

__all__ = ["MAX_FILE_BYTES", "MAX_OUTPUT_BYTES", "AuthError", "BadRequest", "ExecResult", "FileInfo",
           "InvalidState", "Limits", "NotFound", "Sandbox", "SandboxError", "SandboxManager", "SnapshotInfo", "State",
           "Tier", "TooLarge", "Unavailable", "default_manager", "default_state_dir", "set_default_manager"]
