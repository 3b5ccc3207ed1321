"""`k3` command line: `k3 info`, `k3 train`, `k3 sandbox serve`."""

from __future__ import annotations

import argparse
import json
import sys


def _config(args):
    from .config import K3Config
    if args.config:
        return K3Config.from_pretrained(args.config)
    return K3Config.preset(args.preset or "k3")


def cmd_info(args) -> int:
    from .info import format_info, model_info
    info = model_info(_config(args))
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3", description="Kimi K3 in PyTorch")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="layer pattern and parameter counts (meta device, no memory)")
    src = pi.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=["k3", "k3-small", "k3-tiny"])
    src.add_argument("--config", help="a config.json or a checkpoint directory")
    pi.add_argument("--json", action="store_true", help="print JSON")
    pi.set_defaults(func=cmd_info)
    from .train.cli import add_parser as add_train
    add_train(sub)
    from .env.cli import add_parser as add_sandbox
    add_sandbox(sub)
    from .serve.cli import add_parser as add_serve
    add_serve(sub)
    from .post.cli import add_parser as add_post
    add_post(sub)
    from .post.rl_cli import add_parser as add_rl
    add_rl(sub)
    from .parallel.plan import add_parser as add_plan
    add_plan(sub)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"k3 {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
