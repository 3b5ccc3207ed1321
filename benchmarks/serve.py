"""Serving-engine benchmark (k3.serve.Engine) against a plain `model.generate()` loop, same weights, same run.

Measures, for `k3-small` with random bf16 weights on one GPU:
  - decode tokens/s at batch 1 / 32 / 256 (mean step time over the decode phase, CUDA events around the whole
    loop, so that the asynchronous engine's overlap of host and GPU is counted; the same steps with
    `async_scheduling` off and with CUDA graphs off are timed in the same run), and at batch 1
    the fraction of the HBM-bandwidth limit: (active weights + KDA states + MLA latents read per token) ÷ 4.3 TB/s;
  - prefill tokens/s (one long prompt, chunked under the token budget; its first chunk through the prefill graph,
    and again eagerly in the same run);
  - TTFT for a long shared prefix: cold, then a second request that hits the prefix cache;
  - end-to-end greedy throughput of `Engine.generate` vs `model.generate()` on the same batch, and how many
    generated tokens agree.

    python benchmarks/serve.py --out serve.json              # GPU, k3-small (≤ 4 min on one H200)
    python benchmarks/serve.py --smoke --out serve_smoke.json  # CPU, k3-tiny, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_throughput's FLOP count
from k3 import K3Config, K3ForConditionalGeneration  # noqa: E402
from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402

HBM_BYTES_PER_S = 4.3e12  # H200
PEAK_BF16 = 989e12  # H200 dense bf16 FLOP/s (as benchmarks/train_throughput.py)


class Clock:
    """Wall time of a region: CUDA events on GPU (after a synchronize), perf_counter on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t


replay_log: list = []  # `--hit-detail`: (host time of the call, of its return, start, end event) of each replay
hit_detail: dict = {}  # `--hit-detail`: {which hits: [(TTFT, host before the first replay, in the replay calls,
#                        the replays' GPU time) in ms]}


def log_replays() -> None:
    """`--hit-detail`: CUDA events around each CUDAGraph.replay call and its host times, into `replay_log`."""
    fn = torch.cuda.CUDAGraph.replay

    def wrapper(self, *a, **k):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        s.record()
        try:
            return fn(self, *a, **k)
        finally:
            e.record()
            replay_log.append((t, time.perf_counter(), s, e))
    torch.cuda.CUDAGraph.replay = wrapper


def timed_request(eng, prompt: list[int], params, cuda: bool, detail: str | None = None):
    """(seconds, output) of one blocking request. The prompt is built before the clock starts and the output is
    returned, so it is freed after the clock stops: freeing a 16K-token output (its prompt list of Python ints) takes
    ≈ 0.2 ms, the caller's work, not the request's. Free the previous output before calling. `detail` (with
    `log_replays` on): file the request's split (TTFT, host before the first replay, launch, graph GPU ms) under it."""
    replay_log.clear()
    with Clock(cuda) as c:
        out = eng.generate([prompt], params)[0]
    if detail is not None and replay_log:
        hit_detail.setdefault(detail, []).append((1e3 * c.s, 1e3 * (replay_log[0][0] - c.t),
                                                  1e3 * sum(b - a for a, b, _, _ in replay_log),
                                                  sum(x.elapsed_time(y) for _, _, x, y in replay_log)))
    return c.s, out


def build(preset: str, device: str, dtype: torch.dtype, seed: int = 0):
    cfg = K3Config.preset(preset)
    cfg.vision_config = None
    torch.manual_seed(seed)
    with torch.device(device):
        model = K3ForConditionalGeneration(cfg, dtype=dtype)
    return model.eval()


def decode_bytes_per_token(model, ctx: int) -> dict:
    """Bytes a batch-1 decode step must read: non-routed weights (embedding: one row; MTP unused), top-k of
    the routed experts per MoE layer, every KDA state + conv window, and `ctx` MLA latent rows per MLA layer."""
    lm = model.language_model
    cfg = lm.config
    n_layers = cfg.num_hidden_layers
    w = 0
    for name, p in lm.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.startswith("model.embed_tokens"):
            w += p.shape[1] * p.element_size()
        elif name.startswith("model.layers.") and int(name.split(".")[2]) >= n_layers:
            continue  # MTP
        elif ".experts.w" in name:
            w += nbytes * cfg.num_experts_per_token // cfg.num_experts
        else:
            w += nbytes
    la = cfg.linear_attn_config
    n_kda = sum(cfg.is_kda_layer(i) for i in range(n_layers))
    el = lm.lm_head.weight.element_size()
    states = n_kda * (la.num_heads * la.head_dim ** 2 * 4 + 3 * la.num_heads * la.head_dim * (la.short_conv_kernel_size - 1) * el)
    kv = (n_layers - n_kda) * ctx * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * el
    return dict(weights=w, states=states, mla_kv=kv, total=w + states + kv)


def prefill_flops_per_token(cfg, length: int) -> float:
    """Forward model FLOPs per prompt token of one `length`-token prefill: a third of the training count of
    benchmarks/train_throughput.py (6·N_act + MLA + KDA, mean causal context (length + 1) / 2), less the MTP
    layers and the LM head, which a prefill runs for one row only."""
    from train_throughput import flops_per_token, mtp_active_params
    t = cfg.text_config
    f = flops_per_token(cfg, (length + 1) / 2)
    return (f["total"] - 6 * (mtp_active_params(cfg) + t.hidden_size * t.vocab_size)) / 3


def rand_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 16, (n, length), generator=g).tolist()


@contextlib.contextmanager
def no_extend_graphs(engine: Engine):
    """Short chunks run eagerly inside the block (the "before" of the extend graphs, in the same process)."""
    engine.runner.use_extend_graphs = False
    try:
        yield
    finally:
        engine.runner.use_extend_graphs = True


# decode switches that `run` flips in the same run: result key → (module, flag, what the step does with the flag
# on, with it off)
SWITCHES = {
    "greedy_kernel_step_ms": ("k3.ops.sampling", "GREEDY_KERNEL", "greedy pick by two kernels",
                              "greedy pick by torch ops"),
    "mla_write_step_ms": ("k3.ops.mla_decode", "FUSED_WRITE", "MLA latent write with its norm",
                          "MLA latent write plain"),
    "moe_routed_step_ms": ("k3.ops.moe_decode", "ROUTED", "MoE routing inside the expert kernels",
                           "MoE routing by its own kernel"),
    "moe_tiles_step_ms": ("k3.ops.moe_tiles", "ON", "MoE experts by tile kernels", "MoE experts by grouped GEMMs"),
    "gemv_wide_step_ms": ("k3.ops.gemv", "WIDE", "17-64-row projections by the GEMV kernel",
                          "17-64-row projections by cuBLAS"),
    "mla_combine_step_ms": ("k3.ops.mla_decode.triton", "COMBINE_KERNEL", "MLA splits combined by one kernel",
                            "MLA splits combined by PyTorch ops"),
    "mla_page_table_step_ms": ("k3.ops.mla_decode", "PAGE_TABLE", "MLA reading each row's page table",
                               "MLA pages per position"),
    "moe_block_step_ms": ("k3.ops.moe_block", "ON", "a batch-1 step's MoE as one persistent kernel",
                          "a batch-1 step's MoE as eight kernels"),
    "moe_block_split_step_ms": ("k3.ops.moe_block", "SPLIT", "a batch-1 step's MoE block as four launches",
                                "a batch-1 step's MoE block as one launch with grid barriers"),
    "gemv_row_step_ms": ("k3.ops.gemv.triton", "ROW", "one-row projections by the CUDA-core row kernel",
                         "one-row projections by the MMA GEMV kernel"),
    "kda_narrow_step_ms": ("k3.ops.kda.triton.decode", "NARROW", "a small batch's KDA step in narrow column blocks",
                           "a small batch's KDA step in 64-column blocks"),
}


# prefill switches that `run` flips in the same run: result key → (module, flag, with the flag on, with it off)
PREFILL_SWITCHES = {
    "combine_gemms_seconds": ("k3.ops.kda.triton.chunk", "COMBINE_KERNEL", "KDA segment states by one kernel",
                              "KDA segment states by fp32 GEMMs"),
    "mid_intra_seconds": ("k3.ops.kda.triton.chunk", "MID_INTRA", "KDA intra in its mid-size band",
                          "KDA intra at its default settings"),
    "host_tables_seconds": ("k3.serve.runner", "HOST_TABLES", "run tables from the host",
                            "run tables built in the graph"),
}
# prefix-hit switches that `run` flips in the same run: result key → (module, flag, with the flag on, with it off)
HIT_SWITCHES = {
    "moe_tiles_seconds": ("k3.ops.moe_tiles", "ON", "MoE experts by tile kernels", "MoE experts by grouped GEMMs"),
    "gemv_wide_seconds": ("k3.ops.gemv", "WIDE_64", "its 64 rows' projections by the GEMV kernel",
                          "its 64 rows' projections by cuBLAS"),
    "mla_combine_seconds": ("k3.ops.mla_decode.triton", "COMBINE_KERNEL", "the MLA splits combined by one kernel",
                            "the MLA splits combined by PyTorch ops"),
    "host_tables_seconds": ("k3.serve.runner", "HOST_TABLES", "its run tables from the host",
                            "its run tables built in the graph"),
    "mla_page_table_seconds": ("k3.ops.mla_decode", "PAGE_TABLE", "MLA reading each row's page table",
                               "MLA pages per position"),
    "graph_copies_seconds": ("k3.serve.runner", "GRAPH_COPIES", "its admission copies in the graph",
                             "its admission copies as host calls before the graph"),
}


def with_settings(engine: Engine, settings: list[tuple], fn):
    """fn() with each (module, name, value) of `settings` set and the engine's graphs captured afresh, the
    settings and the engine's graphs restored after (a before / after in one run): `k3.ops.gemv.MAX_ROWS = 0`
    (every projection through cuBLAS), `k3.ops._triton.PDL = False` (no programmatic dependent launch),
    `k3.ops.gemv.PROLOGUE = True` (norms and SiTU-GLU inside the GEMVs), each of `SWITCHES` flipped, or all."""
    olds, old_graphs = [getattr(m, n) for m, n, _ in settings], engine.runner.graphs
    try:
        for m, n, v in settings:
            setattr(m, n, v)
        engine.runner.graphs = {}
        engine.reset_prefix_cache()
        return fn()
    finally:
        for (m, n, _), o in zip(settings, olds):
            setattr(m, n, o)
        engine.runner.graphs = old_graphs


def with_setting(engine: Engine, module, name: str, value, fn):
    """`with_settings` for one setting."""
    return with_settings(engine, [(module, name, value)], fn)


def flipped(table: dict) -> dict:
    """{result key: [(module, flag, its flipped value)]} for every switch of `table`, and "all" for all at once."""
    out = {}
    for key, (module, name, *_) in table.items():
        mod = importlib.import_module(module)
        out[key] = [(mod, name, not getattr(mod, name))]
    out["all"] = [s for v in out.values() for s in v]
    return out


def abort_all(engine: Engine) -> None:
    """Drop every request in flight (after a timed run that raised)."""
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.flush()


def decode_rate(engine: Engine, prompts, steps: int, cuda: bool) -> dict:
    """Prefill everything, run 3 decode steps (a graph captured on first use is captured there), then time
    `steps` pure decode steps as one loop (one synchronisation before and after: an asynchronous step returns
    while its forward still runs); tokens/s = tokens returned / time."""
    sp = SamplingParams(max_tokens=steps + 64, temperature=0, ignore_eos=True)  # none finishes while timed
    rids = [engine.submit(p, sp) for p in prompts]
    started = set()
    while len(started) < len(rids):  # every request has its first token: prefill is over
        for o in engine.step():
            if o.new_token_ids:
                started.add(o.request_id)
    for _ in range(3):  # untimed: the batch's first pure decode steps may capture its graph
        engine.step()
    n_tok = []
    with Clock(cuda) as c:
        for _ in range(steps):
            n_tok.append(sum(len(o.new_token_ids) for o in engine.step()))
    for r in rids:
        with contextlib.suppress(KeyError):  # already finished
            engine.abort(r)
    engine.flush()
    assert all(n == len(prompts) for n in n_tok), n_tok
    return dict(batch=len(prompts), step_ms=c.s / steps * 1e3, tokens_per_s=sum(n_tok) / c.s)


def run(a) -> dict:
    cuda = not a.smoke
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    if a.smoke:
        preset, blocks, prompt_len, batches, steps = "k3-tiny", (16, 64), 24, (1, 4, 8), 4
        long_prefill, shared, budget, gen_batch, gen_tokens = 300, 256, 128, 4, 8
    else:
        preset, blocks, prompt_len, batches, steps = "k3-small", (512, 6144), 128, (1, 32, 256), 48
        long_prefill, shared, budget, gen_batch, gen_tokens = 8192, 16384, 8192, 32, 64
    model = build(preset, device, dtype)
    V = model.config.text_config.vocab_size
    ecfg = EngineConfig(hash_block_size=blocks[0], block_size=blocks[1], max_num_batched_tokens=budget,
                        max_num_seqs=max(batches), gpu_memory_fraction=0.5, enable_prefix_caching=True,
                        gc_freeze=a.gc_freeze)
    eng = Engine(model, ecfg)
    res = dict(preset=preset, device=torch.cuda.get_device_name() if cuda else "cpu", dtype=str(dtype),
               hash_block_size=blocks[0], block_size=blocks[1], pool_pages=eng.pool.num_pages,
               page_mib=eng.pool.layout.page_bytes / 2 ** 20)
    # what `k3 serve` does before taking requests: capture the first long prompt's and first decode step's graphs
    # (Triton compilation and autotuning included), timed
    t0 = time.perf_counter()
    res["warm_up"] = dict(graphs=len(eng.warm_up()))
    res["warm_up"]["seconds"] = time.perf_counter() - t0
    # warm-up (kernels, autotuning)
    eng.generate(rand_prompts(2, prompt_len, V, 99), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    eng.reset_prefix_cache()

    res["decode"] = []
    for b in batches:
        eng.reset_prefix_cache()
        r = decode_rate(eng, rand_prompts(b, prompt_len, V, b), steps, cuda)
        eng.config.async_scheduling = False  # the same steps, synchronous (before / after in one run)
        eng.reset_prefix_cache()
        s = decode_rate(eng, rand_prompts(b, prompt_len, V, b), steps, cuda)
        eng.config.async_scheduling = True
        r["sync_step_ms"], r["sync_tokens_per_s"] = s["step_ms"], s["tokens_per_s"]
        if eng.runner.use_graphs:  # the same decode without CUDA graphs (eager), before / after in one run
            eng.runner.use_graphs = False
            eng.reset_prefix_cache()
            e = decode_rate(eng, rand_prompts(b, prompt_len, V, b), steps, cuda)
            eng.runner.use_graphs = True
            r["eager_step_ms"], r["eager_tokens_per_s"] = e["step_ms"], e["tokens_per_s"]
            r["graph_speedup"] = e["step_ms"] / r["step_ms"]
        if b == 1 and eng.runner.use_graphs:  # the projections through cuBLAS; no programmatic dependent launch
            from k3.ops import _triton, gemv
            again = lambda: decode_rate(eng, rand_prompts(b, prompt_len, V, b), steps, cuda)  # noqa: E731
            r["no_gemv_step_ms"] = with_setting(eng, gemv, "MAX_ROWS", 0, again)["step_ms"]
            r["no_pdl_step_ms"] = with_setting(eng, _triton, "PDL", False, again)["step_ms"]
            r["prologue_step_ms"] = with_setting(eng, gemv, "PROLOGUE", True, again)["step_ms"]
        if eng.runner.use_graphs:  # the decode switches not on by default yet, each flipped in the same run
            again = lambda: decode_rate(eng, rand_prompts(b, prompt_len, V, b), steps, cuda)  # noqa: E731
            for key, settings in flipped(SWITCHES).items():
                key = "switches_flipped_step_ms" if key == "all" else key
                try:  # a switch that fails (say, a kernel that does not compile) is reported, not fatal
                    r[key] = with_settings(eng, settings, again)["step_ms"]
                except Exception as e:  # noqa: BLE001
                    r[key + "_error"] = f"{type(e).__name__}: {e}"[:500]
                    abort_all(eng)
        if b == 1:
            ctx = prompt_len + steps // 2
            by = decode_bytes_per_token(model, ctx)
            r["bytes_per_token"] = by
            r["hbm_limit_tokens_per_s"] = HBM_BYTES_PER_S / by["total"]
            r["hbm_fraction"] = r["tokens_per_s"] / r["hbm_limit_tokens_per_s"]
        res["decode"].append(r)

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for warm in (long_prefill, shared + 64):  # compile / autotune the prefill shapes outside the timed runs
        eng.reset_prefix_cache()
        eng.generate(rand_prompts(1, warm, V, 70), one)
    # and a prefix hit of the timed shape (a 64-token tail after `shared` cached tokens: its extend graph is
    # captured here, as a server captures its graphs before taking requests)
    eng.generate([rand_prompts(1, shared, V, 71)[0] + rand_prompts(1, 64, V, 72)[0]], one)
    def cold_prefills() -> float:  # median seconds of three cold prompts of `long_prefill` tokens
        times = []
        for rep in range(3):  # each prompt built before its clock starts, its output freed after it stops
            eng.reset_prefix_cache()
            times.append(timed_request(eng, rand_prompts(1, long_prefill, V, 7 + rep)[0], one, cuda)[0])
        return statistics.median(times)

    sec = cold_prefills()
    res["prefill"] = dict(tokens=long_prefill, seconds=sec, tokens_per_s=long_prefill / sec)
    if eng.runner.use_graphs:  # the same prefills without the prefill graph (eager forward), in the same run
        eng.runner.use_prefill_graphs = False
        eager = cold_prefills()
        eng.runner.use_prefill_graphs = True
        res["prefill"].update(eager_seconds=eager, graph_speedup=eager / sec)
    if eng.runner.use_graphs:  # the prefill switches, each flipped in the same run (its graphs captured afresh)
        def prefills():
            eng.generate([rand_prompts(1, long_prefill, V, 70)[0]], one)  # captures the graph again
            return dict(seconds=cold_prefills())
        for key, settings in flipped(PREFILL_SWITCHES).items():
            if key == "all":
                continue
            try:
                res["prefill"][key] = with_settings(eng, settings, prefills)["seconds"]
            except Exception as e:  # noqa: BLE001
                res["prefill"][key + "_error"] = f"{type(e).__name__}: {e}"[:500]
                abort_all(eng)
    if cuda:
        fl = prefill_flops_per_token(model.config, long_prefill)
        res["prefill"].update(flops_per_token=fl, tflops=fl * long_prefill / sec / 1e12,
                              mfu=fl * long_prefill / sec / PEAK_BF16)
        for key in PREFILL_SWITCHES:
            if key in res["prefill"]:
                res["prefill"][key.replace("_seconds", "_mfu")] = fl * long_prefill / res["prefill"][key] / PEAK_BF16
        if "eager_seconds" in res["prefill"]:
            res["prefill"]["eager_mfu"] = fl * long_prefill / res["prefill"]["eager_seconds"] / PEAK_BF16

    # each of `a.ttft_reps` rounds, on its own prefix: three requests sharing it, each with its own tail. The first
    # computes everything; the second hits if the first's end-of-prompt checkpoint falls inside the shared prefix
    # (tail < hash block), else it stores the junction checkpoint; the third restores the prefix in any case.
    # Each figure is the median over the rounds (a single ~10 ms hit moves with the host's hiccups).
    rounds = {"cold": [], "junction": [], "prefix_hit": [], "prefix_hit_eager_tail": [], "cold_eager_prefill": []}
    for rep in range(a.ttft_reps):
        eng.reset_prefix_cache()
        prefix = rand_prompts(1, shared, V, 8 + 100 * rep)[0]
        tails = rand_prompts(4, 64, V, 9 + 100 * rep)
        for name, tail in zip(("cold", "junction", "prefix_hit"), tails):
            out = None
            s, out = timed_request(eng, prefix + tail, one, cuda, detail=f"main {name}")
            rounds[name].append((s, out.num_cached_tokens))
        if eng.runner.use_graphs:  # the same hit with the tail run eagerly (no extend graph), before / after
            out = None
            with no_extend_graphs(eng):
                s, out = timed_request(eng, prefix + tails[3], one, cuda)
            rounds["prefix_hit_eager_tail"].append((s, out.num_cached_tokens))
            eng.reset_prefix_cache()  # and the cold prompt with its chunks run eagerly (no prefill graph)
            eng.runner.use_prefill_graphs = False
            out = None
            try:
                s, out = timed_request(eng, prefix + tails[0], one, cuda)
            finally:
                eng.runner.use_prefill_graphs = True
            rounds["cold_eager_prefill"].append((s, out.num_cached_tokens))
    ttft = {name: dict(seconds=statistics.median(t for t, _ in r), all_seconds=[t for t, _ in r],
                       cached_tokens=min(n for _, n in r), prompt_tokens=shared + 64)
            for name, r in rounds.items() if r}
    ttft["speedup"] = ttft["cold"]["seconds"] / ttft["prefix_hit"]["seconds"]
    res["ttft_shared_prefix"] = ttft
    if eng.runner.use_graphs:  # the prefix-hit switches, each flipped in the same run (graphs captured afresh)
        def hits() -> dict:  # median seconds of the third request of `a.ttft_reps` rounds, as above
            times = []
            for rep in range(a.ttft_reps):
                eng.reset_prefix_cache()
                prefix = rand_prompts(1, shared, V, 8 + 100 * rep)[0]
                tails = rand_prompts(4, 64, V, 9 + 100 * rep)
                for tail in tails[:2]:
                    eng.generate([prefix + tail], one)
                times.append(timed_request(eng, prefix + tails[2], one, cuda, detail=f"row {key}")[0])
            return dict(seconds=statistics.median(times))
        for key, settings in flipped(HIT_SWITCHES).items():
            if key == "all":
                continue
            try:
                ttft[key] = with_settings(eng, settings, hits)["seconds"]
            except Exception as e:  # noqa: BLE001
                ttft[key + "_error"] = f"{type(e).__name__}: {e}"[:500]
                abort_all(eng)

    eng.reset_prefix_cache()
    prompts = rand_prompts(gen_batch, prompt_len, V, 10)
    sp = SamplingParams(max_tokens=gen_tokens, temperature=0, ignore_eos=True)
    ids = torch.tensor(prompts, device=device)
    model.generate(ids[:2], max_new_tokens=2)  # warm-up
    eng.generate(rand_prompts(gen_batch, prompt_len, V, 11), sp)  # warm-up: this shape's graphs captured
    t_gen, t_eng, t_eager = [], [], []
    for _ in range(a.reps):
        with Clock(cuda) as c:
            ref = model.generate(ids, max_new_tokens=gen_tokens)
        t_gen.append(c.s)
        eng.reset_prefix_cache()
        with Clock(cuda) as c:
            outs = eng.generate(prompts, sp)
        t_eng.append(c.s)
        if eng.runner.use_graphs:  # the prompts' forward eagerly (no extend graph), before / after in one run
            eng.reset_prefix_cache()
            with no_extend_graphs(eng), Clock(cuda) as c:
                eng.generate(prompts, sp)
            t_eager.append(c.s)
    ref = ref[:, prompt_len:].tolist()
    agree = sum(x == y for o, r in zip(outs, ref) for x, y in zip(o.token_ids, r)) / (gen_batch * gen_tokens)
    n = gen_batch * gen_tokens
    res["vs_generate"] = dict(batch=gen_batch, prompt_tokens=prompt_len, new_tokens=gen_tokens,
                              engine_tokens_per_s=n / statistics.median(t_eng),
                              generate_tokens_per_s=n / statistics.median(t_gen),
                              speedup=statistics.median(t_gen) / statistics.median(t_eng),
                              greedy_token_agreement=agree)
    if t_eager:
        res["vs_generate"].update(engine_eager_prefill_tokens_per_s=n / statistics.median(t_eager),
                                  speedup_eager_prefill=statistics.median(t_gen) / statistics.median(t_eager))
    res["engine_stats"] = eng.stats()
    return res


def table(res: dict) -> str:
    lines = [f"serve benchmark: {res['preset']} on {res['device']} ({res['dtype']}), blocks "
             f"{res['hash_block_size']}/{res['block_size']}, {res['pool_pages']} pages of {res['page_mib']:.2f} MiB",
             f"{'decode batch':>14} {'step ms':>9} {'tok/s':>10}"]
    for r in res["decode"]:
        extra = f"   {100 * r['hbm_fraction']:.2f}% of the HBM limit ({r['hbm_limit_tokens_per_s']:.0f} tok/s)" \
            if "hbm_fraction" in r else ""
        if "sync_step_ms" in r:
            extra += f"   (synchronous {r['sync_step_ms']:.2f} ms)"
        if "no_gemv_step_ms" in r:
            extra += f"   (projections by cuBLAS {r['no_gemv_step_ms']:.2f} ms)"
        if "no_pdl_step_ms" in r:
            extra += f"   (without PDL {r['no_pdl_step_ms']:.2f} ms)"
        if "prologue_step_ms" in r:
            extra += f"   (norms and SiTU in the GEMVs' prologues {r['prologue_step_ms']:.2f} ms)"
        for key, (module, name, on, off) in SWITCHES.items():
            if key in r:  # the switch flipped from its setting in this process
                state = on if not getattr(importlib.import_module(module), name) else off
                extra += f"   ({state} {r[key]:.2f} ms)"
            if key + "_error" in r:
                extra += f"   ({name} flipped failed: {r[key + '_error'][:120]})"
        if r.get("switches_flipped_step_ms"):
            extra += f"   (all switches flipped {r['switches_flipped_step_ms']:.2f} ms)"
        if "eager_step_ms" in r:
            extra += f"   (eager {r['eager_step_ms']:.2f} ms, graphs {r['graph_speedup']:.1f}x)"
        lines.append(f"{r['batch']:>14} {r['step_ms']:>9.2f} {r['tokens_per_s']:>10.1f}{extra}")
    w = res["warm_up"]
    lines.append(f"engine warm-up (graphs captured before requests): {w['graphs']} graphs in {w['seconds']:.1f} s")
    p = res["prefill"]
    mfu = f", {p['tflops']:.0f} TFLOP/s, MFU {100 * p['mfu']:.1f}%" if "mfu" in p else ""
    lines.append(f"prefill {p['tokens']} tokens: {p['tokens_per_s']:.0f} tok/s{mfu}")
    if "graph_speedup" in p:
        em = f", MFU {100 * p['eager_mfu']:.1f}%" if "eager_mfu" in p else ""
        lines.append(f"  without the prefill graph: {p['tokens'] / p['eager_seconds']:.0f} tok/s{em} "
                     f"(graph {p['graph_speedup']:.2f}x)")
    for key, (module, name, on, off) in PREFILL_SWITCHES.items():
        if key in p:
            state = on if not getattr(importlib.import_module(module), name) else off
            mk = key.replace("_seconds", "_mfu")
            mfu_f = f", MFU {100 * p[mk]:.1f}%" if mk in p else ""
            lines.append(f"  {state}: {p['tokens'] / p[key]:.0f} tok/s{mfu_f}")
        if key + "_error" in p:
            lines.append(f"  {name} flipped failed: {p[key + '_error'][:160]}")
    t = res["ttft_shared_prefix"]
    lines.append(f"TTFT {t['cold']['prompt_tokens']}-token prompt (median of {len(t['cold']['all_seconds'])}): cold {1e3 * t['cold']['seconds']:.1f} ms, "
                 f"prefix hit ({t['prefix_hit']['cached_tokens']} cached) {1e3 * t['prefix_hit']['seconds']:.1f} ms "
                 f"({t['speedup']:.1f}x); 2nd request ({t['junction']['cached_tokens']} cached) "
                 f"{1e3 * t['junction']['seconds']:.1f} ms")
    if "prefix_hit_eager_tail" in t:
        e = t["prefix_hit_eager_tail"]
        lines.append(f"  prefix hit with the tail run eagerly: {1e3 * e['seconds']:.1f} ms "
                     f"({100 * e['seconds'] / t['cold']['seconds']:.1f}% of cold; with its graph "
                     f"{100 * t['prefix_hit']['seconds'] / t['cold']['seconds']:.1f}%)")
    for key, (module, name, on, off) in HIT_SWITCHES.items():
        if key in t:
            state = on if not getattr(importlib.import_module(module), name) else off
            lines.append(f"  prefix hit with {state}: {1e3 * t[key]:.1f} ms")
        if key + "_error" in t:
            lines.append(f"  prefix hit, {name} flipped, failed: {t[key + '_error'][:160]}")
    if "cold_eager_prefill" in t:
        lines.append(f"  cold with its chunks run eagerly (no prefill graph): "
                     f"{1e3 * t['cold_eager_prefill']['seconds']:.1f} ms")
    g = res["vs_generate"]
    lines.append(f"batch {g['batch']} x {g['new_tokens']} greedy tokens: engine {g['engine_tokens_per_s']:.0f} tok/s, "
                 f"model.generate {g['generate_tokens_per_s']:.0f} tok/s ({g['speedup']:.2f}x), "
                 f"token agreement {100 * g['greedy_token_agreement']:.1f}%")
    if "speedup_eager_prefill" in g:
        lines.append(f"  engine with its prompts' forward eager (no extend graph): "
                     f"{g['engine_eager_prefill_tokens_per_s']:.0f} tok/s ({g['speedup_eager_prefill']:.2f}x)")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="k3-tiny on CPU, tiny sizes")
    ap.add_argument("--reps", type=int, default=2, help="repeats of the engine-vs-generate comparison")
    ap.add_argument("--ttft-reps", type=int, default=3, help="rounds of the cold / prefix-hit TTFT (median reported)")
    ap.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                    help="leave Python's GC as it is (k3 serve freezes it after loading, EngineConfig.gc_freeze)")
    ap.add_argument("--hit-detail", action="store_true",
                    help="split each timed prefix hit into the host time before its graph replay, the replay "
                         "calls and the graph's GPU time (CUDA events around every replay)")
    ap.add_argument("--out", default="serve.json")
    a = ap.parse_args()
    if a.reps < 1 or a.ttft_reps < 1:
        ap.error(f"--reps {a.reps} and --ttft-reps {a.ttft_reps} must be >= 1")
    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --smoke for the CPU check")
    if a.hit_detail and torch.cuda.is_available():
        log_replays()
    t0 = time.time()
    res = run(a)
    res["wall_seconds"] = time.time() - t0
    print(table(res))
    if hit_detail:
        res["hit_detail_ms"] = hit_detail
        print("hit detail, ms (median; each request): TTFT = host before the replay + replay calls + graph GPU + rest")
        for k, rows in hit_detail.items():
            med = [statistics.median(x) for x in zip(*rows)]
            print(f"  {k:32s} TTFT {med[0]:6.3f}  pre {med[1]:6.3f}  launch {med[2]:6.3f}  GPU {med[3]:6.3f}  rest "
                  f"{med[0] - med[1] - med[3]:6.3f}   pre each: {' '.join(f'{r[1]:.2f}' for r in rows)}")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {a.out} ({res['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
