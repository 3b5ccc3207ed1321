"""`k3 serve --checkpoint DIR`: the OpenAI-compatible server (k3.serve.server) over a checkpoint."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..env.cli import is_loopback


def load_tokenizer(checkpoint: Path, text_config):
    """The checkpoint's tokenizer (`tiktoken.model`), else the built-in BPE for its config (with a notice)."""
    from ..io.tokenizer import K3Tokenizer, default_tokenizer
    if (checkpoint / "tiktoken.model").is_file():
        return K3Tokenizer.from_pretrained(checkpoint)
    print(f"k3 serve: {checkpoint} has no tiktoken.model; using the built-in BPE tokenizer for its config",
          file=sys.stderr)
    return default_tokenizer(text_config)


def build_app(args):
    """(app, engine) for parsed `k3 serve` arguments; raises ValueError / FileNotFoundError on bad input."""
    import torch

    from .engine import Engine, EngineConfig
    from .server import ServerLimits, create_app

    from ..train.state import resolve_checkpoint
    limits = ServerLimits(max_body_bytes=int(args.max_body_mb * (1 << 20)),   # bad values fail before loading
                          max_choices_per_request=args.max_choices_per_request, max_pending=args.max_pending)
    key = api_key(args)
    ckpt = resolve_checkpoint(args.checkpoint)  # a checkpoint dir, or a `k3 train` run dir (its latest)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = EngineConfig(block_size=args.block_size, hash_block_size=args.hash_block_size, num_pages=args.num_pages,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_cache,
                       host_cache_bytes=int(args.host_cache_gb * (1 << 30)),
                       gpu_memory_fraction=args.gpu_memory_fraction, gc_freeze=True)
    engine = Engine.from_pretrained(ckpt, cfg, device=args.device, dtype=args.dtype)
    engine.warm_up()  # the first long prompt and the first decode step replay graphs captured now
    tok = load_tokenizer(ckpt, engine.text_config)
    vocab = engine.text_config.vocab_size
    if tok.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model's vocab_size is {vocab}")
    name = args.served_model_name or ckpt.resolve().name
    return create_app(engine, tok, name, engine.max_model_len, limits=limits, api_key=key), engine


def api_key(args) -> str | None:
    """The key clients must send: `--api-key`, else the K3_API_KEY environment variable, else None."""
    key = getattr(args, "api_key", None) or os.environ.get("K3_API_KEY") or None
    if key is not None and not key.strip():
        raise ValueError("the API key is blank; give a non-empty --api-key / K3_API_KEY or none")
    return key


def cmd_serve(args) -> int:
    try:
        import uvicorn
    except ImportError as e:
        print(f"k3 serve: error: {e.name or e} is not installed (pip install fastapi uvicorn)", file=sys.stderr)
        return 2
    if args.api_key:
        print("k3 serve: warning: --api-key is visible to other users in the process list; prefer the "
              "K3_API_KEY environment variable", file=sys.stderr)
    if not is_loopback(args.host) and api_key(args) is None:
        print(f"k3 serve: warning: listening on {args.host} without an API key (set K3_API_KEY)", file=sys.stderr)
    app, engine = build_app(args)
    print(f"k3 serve: {args.checkpoint} on {engine.device} ({engine.dtype}), {engine.pool.num_pages} pool pages, "
          f"max_model_len {engine.max_model_len}: http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_parser(subparsers) -> None:
    """Register `serve --checkpoint DIR [--host H] [--port P] [engine options]`."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible server (chat/completions, SSE, /metrics)")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json + safetensors "
                   "[+ tiktoken.model])")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="model id clients must send (default: the "
                   "checkpoint directory's name)")
    p.add_argument("--device", default=None, help="cuda / cpu / cuda:1 … (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weight dtype (default: the checkpoint's)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (default: the "
                   "model's max_position_embeddings)")
    p.add_argument("--block-size", type=int, default=6144, help="tokens per MLA page (default 6144)")
    p.add_argument("--hash-block-size", type=int, default=512, help="prefix-cache hash block (default 512)")
    p.add_argument("--num-pages", type=int, default=None, help="pool pages (default: from free memory)")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.8, help="share of free GPU memory for the pool")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step (prefill chunks)")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    p.add_argument("--host-cache-gb", type=float, default=0.0, help="host-memory tier for evicted prefixes (GiB)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("K3_THREADS", "0")),
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but "
                   "/health (prefer the K3_API_KEY environment variable: a command line is visible in ps)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="request body limit in MiB (default 32)")
    p.add_argument("--max-choices-per-request", type=int, default=64,
                   help="prompts x n allowed in one request (default 64)")
    p.add_argument("--max-pending", type=int, default=1024, help="engine requests in flight before new "
                   "requests get 429 + Retry-After (default 1024)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
