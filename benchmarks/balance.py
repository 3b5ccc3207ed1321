"""Quantile Balancing vs the DeepSeek-V3 sign rule: max violation (maxvio) of expert loads per step.

Two score sources, every rule replayed on the same sequence of router-score batches:

- synthetic: a skewed sigmoid router (per-expert offsets from +skew to −skew) whose offsets drift
  slowly (a random walk, as a router's weights do in training);
- real: raw router scores captured from a short k3-tiny training run (CPU, Per-Head Muon, byte tokens of
  this Python's standard-library sources), one [tokens, experts] batch per step and MoE layer.

Rules: QB exact, QB histogram (`--bins`), sign rule at several γ. Each starts from a zero bias; at step t it
routes batch t with its current bias (maxvio of those loads is recorded) and then updates the bias from that
batch (the new bias applies from step t+1, as in training). Replay is off-policy: the captured scores do not
react to the replayed bias (the capture run itself used QB; its own maxvio is reported as "capture (QB)").

    python benchmarks/balance.py --out balance.json --plot balance.png
    python benchmarks/balance.py --smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import torch

from k3.train.balance import expert_loads, maxvio, qb_update, qb_update_hist, route_topk, sign_update


def synthetic_batches(steps: int, m: int, n: int, skew: float, drift: float, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    off = torch.linspace(skew, -skew, n)[torch.randperm(n, generator=g)]
    out = []
    for _ in range(steps):
        out.append(torch.sigmoid(torch.randn(m, n, generator=g) + off))
        off = off + drift * torch.randn(n, generator=g)
    return out


def replay(batches: list[torch.Tensor], k: int, rule: str, gamma: float = 0.0, bins: int = 256) -> list[float]:
    """maxvio per step of one rule on a sequence of score batches [m, n]."""
    n = batches[0].shape[1]
    b = torch.zeros(n)
    vio = []
    for s in batches:
        loads = expert_loads(route_topk(s, b, k), n)
        vio.append(maxvio(loads))
        if rule == "qb":
            b = qb_update(s, b, k)
        elif rule == "qb_hist":
            b = qb_update_hist(s, b, k, bins)
        elif rule == "sign":
            b = sign_update(loads.float(), b, gamma)
        elif rule != "none":
            raise ValueError(f"rule={rule!r}")
    return vio


def noise_floor(steps: int, m: int, n: int, k: int, seed: int) -> list[float]:
    """maxvio of a perfectly balanced router in expectation (each token picks k distinct experts uniformly):
    the sampling noise no rule that sees only past batches can remove."""
    g = torch.Generator().manual_seed(seed + 1)
    return [maxvio(expert_loads(torch.rand(m, n, generator=g).topk(k, dim=-1).indices, n)) for _ in range(steps)]


def corpus_tokens(n_tokens: int, vocab: int) -> torch.Tensor:
    """Bytes of the standard library's .py sources (present on every machine), as token ids < 256 ≤ vocab."""
    if vocab < 256:
        raise ValueError(f"vocab={vocab}: byte tokens need ≥ 256")
    buf = bytearray()
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        buf += p.read_bytes()
        if len(buf) >= n_tokens:
            break
    return torch.tensor(list(buf[:n_tokens]), dtype=torch.long)


def capture_real(steps: int, batch: int, seq: int, lr: float, seed: int) -> tuple[dict[str, list[torch.Tensor]], dict]:
    """Train k3-tiny for `steps` steps (QB on, Per-Head Muon) and keep every MoE layer's raw router scores."""
    from k3 import K3Config, K3ForConditionalGeneration
    from k3.model.moe import LatentMoE
    from k3.train.optim import OptimConfig, build_optimizer, build_scheduler

    cfg = K3Config.preset("k3-tiny")
    cfg.vision_config = None
    torch.manual_seed(seed)
    model = K3ForConditionalGeneration(cfg).train()
    moes = {n: m for n, m in model.named_modules() if isinstance(m, LatentMoE)}
    for m in moes.values():
        m.record_routing = True
    opt = build_optimizer(model, OptimConfig(lr=lr))
    sched = build_scheduler(opt, steps)
    toks = corpus_tokens(steps * batch * seq + 1, cfg.text_config.vocab_size)
    scores: dict[str, list[torch.Tensor]] = {n: [] for n in moes}
    losses, capture_vio = [], []
    t0 = time.time()
    for step in range(steps):
        ids = toks[step * batch * seq:(step + 1) * batch * seq].view(batch, seq)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        vio = []
        with torch.no_grad():
            for n, m in moes.items():
                idx, s = m.last_routing
                scores[n].append(s.clone())
                bias = m.gate.e_score_correction_bias
                vio.append(maxvio(expert_loads(idx, bias.numel())))
                bias.copy_(qb_update(s, bias, m.top_k))
        capture_vio.append(sum(vio) / len(vio))
        losses.append(loss.item())
    info = dict(steps=steps, batch=batch, seq=seq, lr=lr, experts=cfg.text_config.num_experts,
                top_k=cfg.text_config.num_experts_per_token, layers=list(moes), loss_first=losses[0],
                loss_last=losses[-1], seconds=time.time() - t0, capture_qb_maxvio=capture_vio)
    return scores, info


def summarize(vio: list[float]) -> dict:
    h = len(vio) // 2
    return dict(step0=vio[0], step1=vio[1] if len(vio) > 1 else float("nan"),
                step5=vio[5] if len(vio) > 5 else float("nan"), final=vio[-1],
                mean_last_half=sum(vio[h:]) / max(1, len(vio) - h))


def run_rules(batches_by_layer: dict[str, list[torch.Tensor]], k: int, gammas: list[float], bins: int) -> dict:
    rules = [("none", "none", 0.0), ("QB exact", "qb", 0.0), (f"QB hist {bins}", "qb_hist", 0.0)]
    rules += [(f"sign γ={g:g}", "sign", g) for g in gammas]
    out = {}
    for label, rule, g in rules:
        per_layer = [replay(b, k, rule, g, bins) for b in batches_by_layer.values()]
        out[label] = [sum(v) / len(v) for v in zip(*per_layer)]  # mean over layers
    return out


def print_table(title: str, res: dict) -> None:
    print(f"\n{title}: maxvio (max load / mean load − 1), mean over layers")
    print("| rule | step 0 | step 1 | step 5 | final | mean of last half |\n|---|---|---|---|---|---|")
    for label, vio in res.items():
        s = summarize(vio)
        print(f"| {label} | {s['step0']:.3f} | {s['step1']:.3f} | {s['step5']:.3f} | {s['final']:.3f} | "
              f"{s['mean_last_half']:.3f} |")


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items()):
        for label, vio in res.items():
            ax.plot(vio, label=label, lw=1.2, ls="--" if label.startswith("sign") else ":" if "floor" in label else "-")
        ax.set_yscale("symlog", linthresh=0.05)
        ax.set_xlabel("step")
        ax.set_ylabel("maxvio")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100, help="synthetic steps")
    ap.add_argument("--tokens", type=int, default=16384, help="synthetic tokens per step (global batch)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--skew", type=float, default=1.5, help="synthetic per-expert logit offsets in [−skew, skew]")
    ap.add_argument("--drift", type=float, default=0.02, help="synthetic offset random-walk step")
    ap.add_argument("--gammas", default="1e-4,1e-3,1e-2", help="sign-rule γ values")
    ap.add_argument("--bins", type=int, default=256)
    ap.add_argument("--real-steps", type=int, default=40, help="k3-tiny training steps to capture (0: skip)")
    ap.add_argument("--real-batch", type=int, default=8)
    ap.add_argument("--real-seq", type=int, default=128)
    ap.add_argument("--real-lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write results as JSON here")
    ap.add_argument("--plot", help="write a PNG plot here")
    ap.add_argument("--smoke", action="store_true", help="tiny configuration (seconds on CPU)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.steps, a.tokens, a.experts, a.topk, a.real_steps, a.real_batch, a.real_seq = 12, 2048, 16, 2, 4, 2, 32
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    gammas = [float(g) for g in a.gammas.split(",") if g]
    results, meta = {}, dict(vars(a))

    syn = synthetic_batches(a.steps, a.tokens, a.experts, a.skew, a.drift, a.seed)
    res = run_rules({"synthetic": syn}, a.topk, gammas, a.bins)
    res["noise floor (uniform router)"] = noise_floor(a.steps, a.tokens, a.experts, a.topk, a.seed)
    results[f"synthetic m={a.tokens} n={a.experts} k={a.topk}"] = res
    if a.real_steps > 0:
        scores, info = capture_real(a.real_steps, a.real_batch, a.real_seq, a.real_lr, a.seed)
        meta["real"] = info
        res = run_rules(scores, info["top_k"], gammas, a.bins)
        res["capture (QB, on-policy)"] = info["capture_qb_maxvio"]
        res["noise floor (uniform router)"] = noise_floor(a.real_steps, a.real_batch * a.real_seq, info["experts"],
                                                          info["top_k"], a.seed)
        results[f"k3-tiny router, m={a.real_batch * a.real_seq} n={info['experts']} k={info['top_k']}"] = res
        print(f"k3-tiny capture: {a.real_steps} steps, loss {info['loss_first']:.3f} → {info['loss_last']:.3f}, "
              f"{info['seconds']:.1f} s, {len(info['layers'])} MoE layers")
    for name, res in results.items():
        print_table(name, res)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(meta=meta, results=results,
                                               summary={n: {r: summarize(v) for r, v in res.items()}
                                                        for n, res in results.items()}), indent=1))
    if a.plot:
        plot(results, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
