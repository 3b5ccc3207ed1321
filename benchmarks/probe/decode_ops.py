"""Every PyTorch op of one eager engine forward, by the line of k3 that issued it, the host cost of a graph
launch and the GPU time of its kernels: k3-small bf16, a batch-1 decode step and a 64-token prefix-hit tail (16K cached). The ops come from a
TorchDispatchMode (each aten call with the innermost k3 frame above it), so the table is exact; the Triton
kernels are not aten ops and are counted by the launches in the profiler instead.

    python benchmarks/probe/decode_ops.py --out decode_ops.json [--no-mla-sweep]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve import build, rand_prompts  # noqa: E402

from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402
from k3.serve.runner import SeqInput  # noqa: E402

VIEWS = {"view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select", "transpose", "t",
         "expand", "as_strided", "unsqueeze", "squeeze", "permute", "alias", "detach", "unbind", "narrow",
         "_reshape_alias", "empty", "empty_like", "empty_strided", "lift_fresh"}


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            frames = [f for f in traceback.extract_stack()[:-1] if "/k3/" in f.filename]
            f = frames[-1] if frames else None
            where = f"{f.filename.split('/k3/')[-1]}:{f.lineno} {f.line.strip()[:70]}" if f else "?"
            self.sites[(name, where)] += 1
        return func(*args, **(kwargs or {}))


def launch_ms(g, n: int = 20) -> tuple[float, float]:
    """Host time of graph.replay() (returns once launched) and the replay's GPU time, medians."""
    host, gpu = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t = time.perf_counter()
        g.graph.replay()
        host.append((time.perf_counter() - t) * 1e3)
        b.record()
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b))
    return statistics.median(host), statistics.median(gpu)


def kernel_times(g, top: int = 25) -> list[tuple[str, int, float]]:
    """(kernel, calls, GPU ms) of one replay of graph g as the profiler sees its kernels (CUPTI traces the kernels
    inside a graph), by total time; an eager run of the same forward when the replay shows none."""
    for fn in (g.graph.replay, g.run):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        rows = [(e.key[:90], e.count, e.self_device_time_total / 1e3) for e in prof.key_averages()
                if e.device_type.name == "CUDA"]
        if rows:
            return sorted(rows, key=lambda r: -r[2])[:top]
    return []


def print_times(rows) -> None:
    total = sum(r[2] for r in rows)
    print(f"   top kernels by GPU time (sum of these {total:.3f} ms):")
    for k, c, ms in rows:
        print(f"   t {ms:7.3f} ms {c:4d}  {k}")


def mla_sweep(model, rows: int = 64, history: int = 16384, reps: int = 20) -> list[dict]:
    """The paged MLA kernel on a prefix hit's shape (`rows` new tokens of one sequence after `history` cached,
    k3-small's heads and latent widths, bf16 pool of 6,144-token pages) for every token-run launch setting of
    `SWEEP_GROUPS` and for one row per program: GPU ms (CUDA events, median of `reps`), fastest first."""
    from k3.model.paged_cache import token_runs
    from k3.ops.mla_decode.triton import LAUNCH, SWEEP_GROUPS, paged_mla_decode_triton
    tc = model.config.text_config
    H, C, R = tc.num_attention_heads, tc.kv_lora_rank, tc.qk_rope_head_dim
    S, ps = history + rows, 6144
    g = torch.Generator(device="cuda").manual_seed(0)
    n_pages = -(-S // ps) + 1
    kv = torch.randn(n_pages, ps, C + R, device="cuda", generator=g).bfloat16()
    pages = (torch.arange(S, device="cuda") // ps)[None].expand(rows, S).contiguous()
    lens = history + 1 + torch.arange(rows, device="cuda")
    q_lat = torch.randn(rows, H, C, device="cuda", generator=g).bfloat16()
    q_pe = torch.randn(rows, H, R, device="cuda", generator=g).bfloat16()
    cu = torch.tensor([0, rows], device="cuda")
    ref = paged_mla_decode_triton(q_lat, q_pe, kv, pages, lens, 0.1)  # one row per program

    def time_it(fn):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)

    from k3.ops.mla_decode import GROUP_ROWS
    cur = token_runs(cu, rows, GROUP_ROWS)
    out = [dict(setting="one row per program", ms=time_it(lambda: paged_mla_decode_triton(
        q_lat, q_pe, kv, pages, lens, 0.1))),
           dict(setting=dict(g=GROUP_ROWS, **LAUNCH["groups"]), current=True, ms=time_it(
               lambda: paged_mla_decode_triton(q_lat, q_pe, kv, pages, lens, 0.1, groups=cur)))]
    for cfg in SWEEP_GROUPS:
        runs = token_runs(cu, rows, cfg["g"])
        launch = {k: v for k, v in cfg.items() if k != "g"}

        def fn(runs=runs, launch=launch, g=cfg["g"]):
            return paged_mla_decode_triton(q_lat, q_pe, kv, pages, lens, 0.1, groups=runs, group_rows=g,
                                           launch=launch)
        err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
        out.append(dict(setting=cfg, ms=time_it(fn), rel_err=err))
    out.sort(key=lambda r: r["ms"])
    flops = 2 * rows * H * history * (2 * C + R)
    print(f"== MLA token runs, {rows} rows after {history} cached, H {H}, C {C}, R {R}: "
          f"{flops / 1e9:.1f} GFLOP per call")
    for r in out[:12] + [r for r in out[12:] if r.get("current")]:
        print(f"   mla {r['ms']:.4f} ms  {flops / r['ms'] / 1e9:6.1f} TFLOP/s  {r['setting']}"
              f"{'  (current)' if r.get('current') else ''}  err {r.get('rel_err', 0):.1e}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_ops.json")
    ap.add_argument("--no-mla-sweep", dest="mla_sweep", action="store_false",
                    help="skip the paged MLA kernel's token-run sweep (~80 s of compiles)")
    a = ap.parse_args()
    model = build("k3-small", "cuda", torch.bfloat16)
    V = model.config.text_config.vocab_size
    eng = Engine(model, EngineConfig(block_size=6144, hash_block_size=512, max_num_seqs=8, gpu_memory_fraction=0.5,
                                     async_scheduling=False))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefix = rand_prompts(1, 16384, V, 8)[0]
    eng.generate([prefix + rand_prompts(1, 64, V, 1)[0]], one)
    rid = eng.submit(rand_prompts(1, 128, V, 2)[0], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    s = eng.requests[rid]
    dec = [SeqInput(tokens=[s.tokens[-1]], start=s.num_tokens - 1, state_page=s.state_page, mla_pages=s.mla_pages,
                    want_logits=True)]
    res = {}
    r = eng.runner
    for name, seqs in (("decode_b1", dec),):
        g = r.graph_for(seqs)
        g.fill(seqs, r.scratch)
        g.buf.copy_(g.host)
        res[name] = dict(zip(("launch_host_ms", "replay_gpu_ms"), launch_ms(g)))
        mode = Ops()
        with mode:
            g.run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.run()
            torch.cuda.synchronize()
        kern = collections.Counter()
        for e in prof.key_averages():
            if e.device_type.name == "CUDA":
                kern[e.key[:80]] += e.count
        res[name]["kernels"] = sum(kern.values())
        res[name]["aten_ops"] = sum(mode.sites.values())
        res[name]["sites"] = [(n, w, c) for (n, w), c in mode.sites.most_common()]
        res[name]["kernel_names"] = kern.most_common()
        print(f"== {name}: graph launch {res[name]['launch_host_ms']:.3f} ms host, replay {res[name]['replay_gpu_ms']:.3f}"
              f" ms GPU; {res[name]['kernels']} kernels, {res[name]['aten_ops']} aten ops")
        for n, w, c in res[name]["sites"]:
            print(f"   {c:4d}  {n:28s} {w}")
        for k, c in kern.most_common(60):
            print(f"   k {c:4d}  {k}")
        res[name]["kernel_times"] = kernel_times(g)
        print_times(res[name]["kernel_times"])
    # the prefix-hit tail's extend graph: launch cost only
    eng.generate([prefix + rand_prompts(1, 64, V, 3)[0]], one)
    hits = [g for k, g in r.graphs.items() if k[0] == "extend" and k[1] == 64]
    if hits:
        res["hit_extend"] = dict(zip(("launch_host_ms", "replay_gpu_ms"), launch_ms(hits[0])))
        print(f"== hit extend graph: launch {res['hit_extend']['launch_host_ms']:.3f} ms host, replay "
              f"{res['hit_extend']['replay_gpu_ms']:.3f} ms GPU")
        res["hit_extend"]["kernel_times"] = kernel_times(hits[0])
        print_times(res["hit_extend"]["kernel_times"])
    if a.mla_sweep:
        res["mla_sweep"] = mla_sweep(model)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
