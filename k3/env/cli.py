"""`k3 sandbox serve`: run the sandbox REST server (k3.env.server) over a state directory."""

from __future__ import annotations

import ipaddress
import os
import sys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args) -> int:
    try:
        from .server import serve
    except ImportError as e:
        print(f"k3 sandbox serve: error: {e.name or e} is not installed (pip install fastapi uvicorn)", file=sys.stderr)
        return 2
    from .base import SandboxError
    from .manager import SandboxManager, default_state_dir

    api_key = args.api_key if args.api_key is not None else os.environ.get("K3_SANDBOX_API_KEY") or None
    if api_key is None and not is_loopback(args.host):
        print(f"k3 sandbox serve: warning: listening on {args.host} without an API key; anyone who can reach "
              "it can run commands in its sandboxes (set --api-key or K3_SANDBOX_API_KEY)", file=sys.stderr)
    if args.base_root:  # read by the process tier when the manager creates it
        from .process.bases import BASE_ROOTS_ENV
        os.environ[BASE_ROOTS_ENV] = os.pathsep.join(os.path.realpath(r) for r in args.base_root)
    try:
        manager = SandboxManager(args.state_dir or default_state_dir())
    except SandboxError as e:
        print(f"k3 sandbox serve: error: {e}", file=sys.stderr)
        return 2
    print(f"k3 sandbox serve: state dir {manager.state_dir}, http://{args.host}:{args.port}"
          f"{' (X-API-Key required)' if api_key else ''}", file=sys.stderr)
    serve(manager, host=args.host, port=args.port, api_key=api_key, log_level=args.log_level)
    return 0


def add_parser(subparsers) -> None:
    """Register `sandbox serve [--host H] [--port P] [--state-dir D] [--api-key K]`."""
    p = subparsers.add_parser("sandbox", help="agent sandboxes (REST server)")
    sub = p.add_subparsers(dest="sandbox_cmd", required=True)
    s = sub.add_parser("serve", help="run the sandbox REST server; running sandboxes are paused on exit")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--state-dir", default=None,
                   help="sandbox state directory (default $K3_SANDBOX_DIR or ~/.cache/k3/sandboxes)")
    s.add_argument("--api-key", default=None,
                   help="require this X-API-Key on every request but /health (default $K3_SANDBOX_API_KEY)")
    s.add_argument("--base-root", action="append", default=[], metavar="DIR",
                   help="a directory whose subdirectories and tarballs requests may name as a base by absolute path "
                        "(repeatable; default $K3_SANDBOX_BASE_ROOTS; none: only 'default' and names under "
                        "<state-dir>/process/bases/)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)
