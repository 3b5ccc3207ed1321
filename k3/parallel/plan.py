"""`k3 plan`: per-rank memory and communication of a training layout, from the config numbers alone.

    k3 plan --preset k3 --gpus 256 --seq 1M --pp 8 --ep 32 --dp 1 --cp 1

Layout: `ParallelDims(pp, dp_shard, cp, ep)` (k3.parallel.mesh); world = pp·dp_shard·cp·ep. Notation:
D hidden, V vocab, L decoder layers, E experts, k top-k, Lr = routed_expert_hidden_size (the latent the experts
run in), I = moe_intermediate_size, Id = intermediate_size (dense MLP), ns shared experts, H MLA heads with
dn/dr/dv (nope/rope/v dims), qr/kvr the q/kv LoRA ranks, Hk/K the KDA heads and head dim (HK = Hk·K), W the
short-conv width, S = seq/cp tokens of one sequence on one rank, b the micro-batch (sequences per rank).

Parameters (elements; `layer_tensors` lists every tensor's shape, the same shapes the model builds):
- KDA attention: 4·D·HK (q,k,v,g) + HK·D (o) + 3·HK·W (convs) + D·K + K·HK (f_a, f_b) + D·Hk (b)
  + ⌈Hk/128⌉·128 (A_log) + HK (dt_bias) + K (o_norm);
- MLA attention: D·qr + qr + qr·H(dn+dr) + D(kvr+dr) + kvr + kvr·H(dn+dv) + D·H·dv (g) + H·dv·D (o);
- FFN: dense 3·D·Id; MoE router E·D, latent down/up 2·D·Lr, norm Lr, shared 3·D·(ns·I), experts 3·E·I·Lr;
- per layer 2·D norms + 4·D AttnRes sites (two RMSNorm + [1, D] queries); embedding V·D on stage 0; lm_head
  V·D + norm + output AttnRes 3·D, and each MTP layer (MLA + MoE + 5·D norms + eh_proj 2·D·D) on the last stage.
Stage s holds layers `stage_layers(L, pp)[s]`. On a rank: every non-expert tensor [d0, …] is FSDP2-sharded over
fsdp = dp_shard·cp·ep ranks, which allocates ⌈d0/fsdp⌉·(rest) elements (dim-0 chunks, padded); the routed
experts keep E/ep home experts, FSDP-sharded over efsdp = dp_shard·cp: ⌈(E/ep)/efsdp⌉·I·Lr per matrix.
Bytes per element by `precision` (parameters / gradients / optimizer states): "fp32" 4/4/4 (what
`k3 train` does today: fp32 master weights under bf16 autocast), "bf16" 2/2/4 (bf16 parameters and gradient
reduction, fp32 states: the only way the full K3 fits on 256 H200s), "bf16-states" 2/2/2. Optimizer states:
Muon 1 state for matrices and stacked experts, AdamW 2 for the rest (embedding, lm_head, vectors, [1, D]
queries, convs) — `k3.train.optim.classify_parameters`'s rule.

Activations (saved for backward, per micro-batch, `act_bytes` per element, 2 for bf16): per token of a layer
- every layer: 2·D (two norm inputs) + 2·D (the AttnRes mixes' outputs) + D (layer output);
- KDA: D (normed input) + 3·HK (projections before conv) + 3·HK (after conv) + K + 2·HK (gate low rank/full)
  + Hk (beta) + 2·HK (g-proj out, attention out) + HK (o_norm out);
- MLA: D + qr + qr + H(dn+dr) + (kvr+dr) + kvr + H(dn+dv) + 3·H·dv (attention out, gate, gated);
- MoE: D + E (router scores) + Lr + k·Lr (dispatched rows) + 3·k·I (w1, w3 outputs, SiTU-GLU) + k·Lr
  (expert out) + 2·Lr (combine, norm) + [shared 3·ns·I];  dense FFN: D + 3·Id;
- AttnRes block sums live across the stage: (⌈L_stage/block⌉+1)·D;
- head (last stage): D with the fused linear-CE head (the default `loss_impl`), + V·4/act_bytes (fp32 logits)
  with `fused_ce=False`; each MTP layer adds an MoE/MLA layer's worth plus 3·D.
Times S·b tokens per micro-batch; with gradient checkpointing only the layer inputs and block sums stay, plus
the recomputed activations of the largest single layer.
With pp > 1, 1F1B keeps up to pp micro-batches in flight on stage 0 (reported: `activation_inflight`).

Communication per rank per optimizer step (bytes over the network, ring algorithms: (n−1)/n of the data):
- FSDP: all-gather bf16 parameters forward and again backward for each of m micro-batches, reduce-scatter
  the gradients once per step: (2·2·m + g)·P_stage_nonexpert·(fsdp−1)/fsdp, g the gradient bytes of
  `precision`; the E/ep home experts the same over efsdp;
- MoonEP, per MoE layer and micro-batch: dispatch + combine forward and their transposes backward, bf16 latent
  rows: 4·S·b·k·Lr·2·(ep−1)/ep; prefetch of ≤ E/ep remote experts (bf16, forward + backward re-prefetch)
  2·3·(E/ep)·I·Lr·2 and reduce_grad fp32 3·(E/ep)·I·Lr·4 (upper bounds: at most E/ep remote experts per rank);
- CP, per micro-batch: KDA one all-gather of the segment state and K×K transition per layer and direction:
  2·cp·Hk·K·2K·4; MLA gathers the latent (kvr+dr) of the whole sequence forward, reduce-scatters it backward:
  2·seq·b·(kvr+dr)·2·(cp−1)/cp;
- PP, per micro-batch and stage boundary: the AttnRes block sums and the running partial sum, forward
  activations and their gradients: 2·(blocks+1)·S·b·D·2.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

from .mesh import ParallelDims, stage_layers

GB = 1e9
H200_BYTES = 141e9
PRECISIONS = {"fp32": (4, 4, 4), "bf16": (2, 2, 4), "bf16-states": (2, 2, 2)}


# ---- tensor tables -----------------------------------------------------------------------------------
# Each entry: (shape, kind) with kind "muon" (1 optimizer state), "adam" (2) or "expert" (stacked experts:
# sharded over ep, Muon). Shapes match the model's parameters (checked against the module tree in tests).
def _kda(c) -> list:
    la = c.linear_attn_config
    D, Hk, K, W = c.hidden_size, la.num_heads, la.head_dim, la.short_conv_kernel_size
    HK = Hk * K
    return ([((HK, D), "muon")] * 3 + [((HK, 1, W), "adam")] * 3
            + [((K, D), "muon"), ((HK, K), "muon"), ((math.ceil(Hk / 128) * 128,), "adam"), ((HK,), "adam"),
               ((Hk, D), "muon"), ((HK, D), "muon"), ((K,), "adam"), ((D, HK), "muon")])


def _mla(c) -> list:
    D, H = c.hidden_size, c.num_attention_heads
    dn, dr, dv, qr, kvr = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank, c.kv_lora_rank
    q = ([((qr, D), "muon"), ((qr,), "adam"), ((H * (dn + dr), qr), "muon")] if qr
         else [((H * (dn + dr), D), "muon")])
    out = q + [((kvr + dr, D), "muon"), ((kvr,), "adam"), ((H * (dn + dv), kvr), "muon")]
    if c.mla_use_output_gate:
        out.append(((H * dv, D), "muon"))
    return out + [((D, H * dv), "muon")]


def _moe(c) -> list:
    D, E, Lr, I = c.hidden_size, c.num_experts, c.routed_expert_hidden_size, c.moe_intermediate_size
    out = [((E, D), "muon"), ((Lr, D), "muon")] + [((E, I, Lr), "expert"), ((E, Lr, I), "expert"),
                                                  ((E, I, Lr), "expert")]
    if c.latent_moe_use_norm:
        out.append(((Lr,), "adam"))
    out.append(((D, Lr), "muon"))
    if c.num_shared_experts:
        Is = c.num_shared_experts * I
        out += [((Is, D), "muon"), ((Is, D), "muon"), ((D, Is), "muon")]
    return out


def layer_tensors(c, i: int) -> list:
    """Parameter shapes of decoder layer i (0-based; i ≥ L: an MTP layer) of text config `c`."""
    D = c.hidden_size
    L = c.num_hidden_layers
    if i >= L:  # MTP: MLA + MoE, two norms, enorm/hnorm/eh_proj/shared_head.norm, no AttnRes sites
        return (_mla(c) + _moe(c) + [((D,), "adam")] * 2 + [((D,), "adam")] * 2 + [((D, 2 * D), "muon")]
                + [((D,), "adam")])
    attn = _kda(c) if c.is_kda_layer(i) else _mla(c)
    ffn = _moe(c) if c.is_moe_layer(i) else [((c.intermediate_size, D), "muon")] * 2 + [((D, c.intermediate_size),
                                                                                         "muon")]
    return attn + ffn + [((D,), "adam")] * 2 + [((D,), "adam"), ((1, D), "adam")] * 2


def stage_tensors(c, pp: int, stage: int) -> list:
    """Parameter shapes held by pipeline stage `stage`."""
    D, V, L = c.hidden_size, c.vocab_size, c.num_hidden_layers
    out = [((V, D), "adam")] if stage == 0 else []
    for i in stage_layers(L, pp)[stage]:
        out += layer_tensors(c, i)
    if stage == pp - 1:
        for k in range(c.num_nextn_predict_layers):
            out += layer_tensors(c, L + k)
        out += [((D,), "adam"), ((D,), "adam"), ((1, D), "adam"), ((V, D), "adam")]
    return out


def _numel(shape) -> int:
    return math.prod(shape)


def _shard(shape, n: int) -> int:
    """Elements FSDP2 allocates on one of n ranks for a tensor: the padded dim-0 chunk."""
    return math.ceil(shape[0] / n) * _numel(shape[1:])


# ---- activations ---------------------------------------------------------------------------------------
def _act_per_token(c, i: int) -> int:
    """Elements saved for backward per token by decoder layer i (module docstring; i ≥ L: MTP, MLA + MoE)."""
    D = c.hidden_size
    common = 5 * D
    if i < c.num_hidden_layers and c.is_kda_layer(i):
        la = c.linear_attn_config
        HK, K = la.num_heads * la.head_dim, la.head_dim
        attn = D + 3 * HK + 3 * HK + K + 2 * HK + la.num_heads + 2 * HK + HK
    else:
        H = c.num_attention_heads
        attn = (D + 2 * c.q_lora_rank + H * (c.qk_nope_head_dim + c.qk_rope_head_dim)
                + c.kv_lora_rank + c.qk_rope_head_dim + c.kv_lora_rank
                + H * (c.qk_nope_head_dim + c.v_head_dim) + 3 * H * c.v_head_dim)
    if i >= c.num_hidden_layers or c.is_moe_layer(i):
        k, Lr, I = c.num_experts_per_token, c.routed_expert_hidden_size, c.moe_intermediate_size
        ffn = D + c.num_experts + Lr + k * Lr + 3 * k * I + k * Lr + 2 * Lr + 3 * c.num_shared_experts * I
    else:
        ffn = D + 3 * c.intermediate_size
    return common + attn + ffn


@dataclass
class Plan:
    """Per-rank bytes of the heaviest rank (the largest stage), and the layout that produced them."""

    preset: str
    precision: str
    gpus: int
    seq: int
    micro_batch: int
    pp: int
    dp_shard: int
    cp: int
    ep: int
    stage_layers: list[int]
    params_total: int            # elements of the whole model (text)
    param_bytes: int             # per rank (fp32 master, FSDP/EP sharded)
    grad_bytes: int
    optim_bytes: int
    activation_bytes: int        # one micro-batch
    activation_inflight: int     # 1F1B: min(pp, micro-batches) micro-batches in flight on stage 0
    ep_buffer_bytes: int         # MoonEP prefetch pool (bf16) + reduce buffer (fp32) for ≤ E/ep remote experts
    fsdp_gather_bytes: int       # the largest layer's unsharded bf16 parameters (×2: prefetch of the next)
    comm_fsdp: int               # bytes sent per rank per step
    comm_ep: int
    comm_cp: int
    comm_pp: int
    total_bytes: int
    fits: bool
    device_bytes: float

    def format(self) -> str:
        rows = [("parameters (sharded)", self.param_bytes), ("gradients", self.grad_bytes),
                ("optimizer states", self.optim_bytes),
                ("activations / micro-batch", self.activation_bytes),
                (f"activations in flight (×{self.activation_inflight // max(self.activation_bytes, 1)})",
                 self.activation_inflight),
                ("MoonEP prefetch + reduce buffers", self.ep_buffer_bytes),
                ("FSDP unsharded layer buffers", self.fsdp_gather_bytes),
                ("total per rank", self.total_bytes),
                ("comm / step: FSDP", self.comm_fsdp), ("comm / step: MoonEP", self.comm_ep),
                ("comm / step: CP", self.comm_cp), ("comm / step: PP", self.comm_pp)]
        head = (f"{self.preset}: {self.params_total / 1e9:.3f} B params, {self.gpus} GPUs = pp {self.pp} × dp_shard "
                f"{self.dp_shard} × cp {self.cp} × ep {self.ep}; seq {self.seq}, micro-batch {self.micro_batch}, "
                f"precision {self.precision}; "
                f"layers per stage {self.stage_layers}")
        body = "\n".join(f"  {k:<40} {v / GB:12.3f} GB" for k, v in rows)
        verdict = (f"  fits in {self.device_bytes / GB:.0f} GB: {'yes' if self.fits else 'NO'} "
                   f"({100 * self.total_bytes / self.device_bytes:.0f}%)")
        return f"{head}\n{body}\n{verdict}"


def make_plan(config, dims: ParallelDims, seq: int, micro_batch: int = 1, micro_batches: int | None = None,
              act_bytes: int = 2, gradient_checkpointing: bool = False, device_bytes: float = H200_BYTES,
              precision: str = "fp32", fused_ce: bool = True, name: str = "") -> Plan:
    """Per-rank volumes of the heaviest stage for text config `config` (a K3TextConfig) under `dims`.
    micro_batches: per optimizer step and rank (default: pp, the least that fills a 1F1B pipeline)."""
    c = config
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {sorted(PRECISIONS)}")
    pb, gb, sb = PRECISIONS[precision]
    dims.validate(config=c, seq_len=seq)
    if micro_batch < 1:
        raise ValueError(f"micro_batch={micro_batch} must be >= 1")
    mbs = micro_batches if micro_batches is not None else dims.pp
    if mbs < 1:
        raise ValueError(f"micro_batches={mbs} must be >= 1")
    fsdp, efsdp, ep, cp, pp = dims.fsdp, dims.efsdp, dims.ep, dims.cp, dims.pp
    E, k, Lr, I, D = (c.num_experts, c.num_experts_per_token, c.routed_expert_hidden_size,
                      c.moe_intermediate_size, c.hidden_size)
    epn = E // ep
    S = seq // cp * micro_batch  # tokens per rank per micro-batch
    ranges = stage_layers(c.num_hidden_layers, pp)
    total = sum(_numel(s) for st in range(pp) for s, _ in stage_tensors(c, pp, st))

    best = None
    for st in range(pp):
        ts = stage_tensors(c, pp, st)
        p = o = 0
        big_layer = 0
        n_moe = sum(c.is_moe_layer(i) for i in ranges[st]) + (c.num_nextn_predict_layers if st == pp - 1 else 0)
        n_mla = sum(not c.is_kda_layer(i) for i in ranges[st]) + (c.num_nextn_predict_layers if st == pp - 1 else 0)
        n_kda = sum(c.is_kda_layer(i) for i in ranges[st])
        nonexp = exp = 0
        for shape, kind in ts:
            if kind == "expert":
                n = _shard((epn,) + tuple(shape[1:]), efsdp)
                exp += n
            else:
                n = _shard(shape, fsdp)
                nonexp += n
            p += n
            o += n * (2 if kind == "adam" else 1)
        layers = list(ranges[st]) + ([c.num_hidden_layers + j for j in range(c.num_nextn_predict_layers)]
                                     if st == pp - 1 else [])
        for i in layers:
            full = sum(_numel(s) if kd != "expert" else _numel((epn,) + tuple(s[1:])) for s, kd in layer_tensors(c, i))
            big_layer = max(big_layer, full)
        # activations
        per_layer = [_act_per_token(c, i) + (3 * D if i >= c.num_hidden_layers else 0) for i in layers]
        per_tok = len(layers) * D + max(per_layer) if gradient_checkpointing else sum(per_layer)
        blocks = math.ceil(len(ranges[st]) / c.attn_res_block_size) + 1
        per_tok += blocks * D
        if st == pp - 1:
            per_tok += D + (0 if fused_ce else c.vocab_size * 4 // act_bytes)
        act = per_tok * S * act_bytes
        inflight = act * min(pp - st, mbs)
        ep_buf = (3 * epn * I * Lr * (2 + 4)) if ep > 1 and n_moe else 0
        gather = 2 * big_layer * 2 if fsdp > 1 else 0
        # communication per step
        ring = lambda n: (n - 1) / n  # noqa: E731
        c_fsdp = (2 * 2 * mbs + gb) * (nonexp * fsdp) * ring(fsdp) + (2 * 2 * mbs + gb) * (exp * efsdp) * ring(efsdp)
        c_ep = mbs * n_moe * (4 * S * k * Lr * 2 * ring(ep) + (2 * 3 * epn * I * Lr * 2 + 3 * epn * I * Lr * 4)
                              * (ep > 1))
        la = c.linear_attn_config
        c_cp = (mbs * (n_kda * 2 * cp * la.num_heads * la.head_dim * 2 * la.head_dim * 4
                       + n_mla * 2 * seq * micro_batch * (c.kv_lora_rank + c.qk_rope_head_dim) * 2 * ring(cp))
                if cp > 1 else 0)
        c_pp = mbs * 2 * blocks * S * D * 2 * (1 if st in (0, pp - 1) else 2) if pp > 1 else 0
        tot = p * pb + p * gb + o * sb + inflight + ep_buf + gather
        cand = (tot, st, p, o, act, inflight, ep_buf, gather, int(c_fsdp), int(c_ep), int(c_cp), int(c_pp))
        if best is None or cand[0] > best[0]:
            best = cand
    tot, st, p, o, act, inflight, ep_buf, gather, c_fsdp, c_ep, c_cp, c_pp = best
    return Plan(name, precision, dims.world_size, seq, micro_batch, dims.pp, dims.dp_shard, dims.cp, dims.ep,
                [len(r) for r in ranges], total, p * pb, p * gb, o * sb, act, inflight, ep_buf, gather, c_fsdp,
                c_ep, c_cp, c_pp, tot, tot <= device_bytes, device_bytes)


def rank_param_elements(config, dims: ParallelDims, stage: int) -> int:
    """Parameter elements one rank of `stage` allocates (the `param_bytes` formula, per stage)."""
    epn = config.num_experts // dims.ep
    return sum(_shard((epn,) + tuple(s[1:]), dims.efsdp) if kd == "expert" else _shard(s, dims.fsdp)
               for s, kd in stage_tensors(config, dims.pp, stage))


# ---- CLI ---------------------------------------------------------------------------------------------
def parse_tokens(s: str) -> int:
    """'1M' → 1048576, '128K' → 131072, '4096' → 4096 (binary units, as sequence lengths are)."""
    t = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        v = int(num) * mult
    except ValueError:
        raise ValueError(f"sequence length {s!r}: expected an integer with an optional K/M/G suffix") from None
    if v < 1:
        raise ValueError(f"sequence length {s!r} must be >= 1")
    return v


def add_parser(sub) -> None:
    """Register `k3 plan` on an argparse sub-parsers object."""
    p = sub.add_parser("plan", help="per-rank parameter/gradient/optimizer/activation memory and communication "
                                    "of a parallel layout (no GPU needed)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="k3", choices=["k3", "k3-small", "k3-tiny"])
    src.add_argument("--config", help="a config.json or a checkpoint directory")
    p.add_argument("--gpus", type=int, required=True, help="world size")
    p.add_argument("--seq", default="4K", help="sequence length per sample, e.g. 4096, 128K, 1M")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--dp", type=int, default=None, help="dp_shard (default: gpus / (pp·cp·ep))")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per micro-batch")
    p.add_argument("--micro-batches", type=int, default=None, help="per step (default: pp)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (keep layer inputs)")
    p.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS),
                   help="bytes of parameters/gradients/optimizer states: fp32 4/4/4, bf16 2/2/4, bf16-states 2/2/2")
    p.add_argument("--device-gb", type=float, default=H200_BYTES / GB, help="device memory (default H200 141)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from ..config import K3Config

    cfg = K3Config.from_pretrained(args.config) if args.config else K3Config.preset(args.preset)
    rest = args.pp * args.cp * args.ep
    if args.dp is None:
        if args.gpus % rest:
            raise ValueError(f"--gpus {args.gpus} is not divisible by pp·cp·ep = {rest}")
        dp = args.gpus // rest
    else:
        dp = args.dp
    dims = ParallelDims(args.pp, dp, args.cp, args.ep).validate(world_size=args.gpus)
    plan = make_plan(cfg.text_config, dims, parse_tokens(args.seq), args.micro_batch, args.micro_batches,
                     gradient_checkpointing=args.checkpointing, device_bytes=args.device_gb * GB,
                     precision=args.precision,
                     name=args.config or args.preset)
    print(json.dumps(asdict(plan), indent=2) if args.json else plan.format())
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m k3.parallel.plan …` (the same as `k3 plan …`)."""
    ap = argparse.ArgumentParser(prog="k3")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(["plan"] + list(argv if argv is not None else __import__("sys").argv[1:]))
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
