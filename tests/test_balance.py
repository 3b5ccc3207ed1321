"""Quantile Balancing (exact, histogram, all-reduced), the sign rule, and the training-loop controller."""

import copy

import pytest
import torch

from conftest import make_tiny
from k3.parallel._launch import spawn_gloo
from k3.train.qkclip import QKClip
from k3.train.balance import (BalanceController, MarginHistogram, expert_loads, maxvio, qb_margins, qb_update,
                              qb_update_hist, route_topk, sign_update)


def skewed_scores(m, n, skew, gen):
    """Stationary skewed router: sigmoid(noise + per-expert offset from +skew down to −skew)."""
    return torch.sigmoid(torch.randn(m, n, generator=gen) + torch.linspace(skew, -skew, n))


def qb_oracle(scores, bias, k):
    """Direct transcription of K3_SPEC §5 in fp64 with torch.quantile, one expert at a time."""
    s = scores.double()
    m, n = s.shape
    out = torch.empty(n, dtype=torch.float64)
    alpha = torch.stack([torch.sort(s[i] + bias.double(), descending=True).values[k] for i in range(m)])
    for j in range(n):
        out[j] = -torch.quantile(s[:, j] - alpha, 1 - k / n)
    return out - out.mean()


def test_figure5_worked_example():
    """8 tokens, 4 experts, top-1 (target 2 each): raw loads (4, 3, 1, 0) → (2, 2, 2, 2) after one QB update."""
    s = torch.tensor([[0.35, 0.85, 0.20, 0.40], [0.75, 0.15, 0.60, 0.65], [0.80, 0.45, 0.10, 0.60],
                      [0.50, 0.05, 0.25, 0.35], [0.15, 0.50, 0.65, 0.25], [0.65, 0.30, 0.35, 0.15],
                      [0.70, 0.90, 0.40, 0.60], [0.05, 0.70, 0.65, 0.35]])
    b0 = torch.zeros(4)
    assert expert_loads(route_topk(s, b0, 1), 4).tolist() == [4, 3, 1, 0]
    b1 = qb_update(s, b0, 1)
    biased = (s + b1).sort(dim=-1, descending=True).values
    assert (biased[:, 0] - biased[:, 1]).min() > 1e-3  # no near-ties: the routing below is not a rounding accident
    assert expert_loads(route_topk(s, b1, 1), 4).tolist() == [2, 2, 2, 2]
    assert abs(b1.sum().item()) < 1e-6


def test_exact_qb_matches_oracle_and_crossing_count():
    g = torch.Generator().manual_seed(0)
    for m, n, k in [(50, 6, 2), (37, 8, 1), (64, 16, 4)]:
        s = skewed_scores(m, n, 1.0, g)
        b = 0.1 * torch.randn(n, generator=g)
        new = qb_update(s, b, k)
        assert torch.allclose(new.double(), qb_oracle(s, b, k), atol=1e-6)
        # definition: −b̂ (un-centred) is the (1 − k/n) quantile of each expert's margins, so about q = m·k/n
        # margins lie above it (ties: a token's (k+1)-th expert l has margin exactly −b_l, so count ≥ and >)
        marg = qb_margins(s, b, k).double()
        t = -new.double() + (torch.quantile(marg[:, 0], 1 - k / n) + new[0])  # b̂ = new + mean(b̂)
        q = m * k / n
        assert ((marg > t + 1e-6).sum(0) <= q + 1).all() and ((marg >= t - 1e-6).sum(0) >= q - 1).all()


def test_one_qb_update_balances_a_stationary_distribution_and_beats_sign_rule():
    """Figure 5 in spirit at scale: heavily unbalanced → nearly balanced after one QB update on a new batch of
    the same distribution; a few more updates reach the sampling-noise floor; the sign rule is still far off."""
    g = torch.Generator().manual_seed(1)
    m, n, k = 8192, 16, 2
    b_qb, b_sign = torch.zeros(n), torch.zeros(n)
    vio_qb, vio_sign = [], []
    for _ in range(6):
        s = skewed_scores(m, n, 1.0, g)
        vio_qb.append(maxvio(expert_loads(route_topk(s, b_qb, k), n)))
        loads = expert_loads(route_topk(s, b_sign, k), n)
        vio_sign.append(maxvio(loads))
        b_qb = qb_update(s, b_qb, k)
        b_sign = sign_update(loads, b_sign, 1e-3)
    assert vio_qb[0] > 1.5  # expert 0 gets > 2.5× its share without balancing
    assert vio_qb[1] < 0.35 and min(vio_qb[2:]) < 0.15, vio_qb
    assert min(vio_sign) > 1.4, vio_sign


def test_histogram_agrees_with_exact_within_bin_width():
    g = torch.Generator().manual_seed(2)
    m, n, k = 6000, 12, 3
    s = skewed_scores(m, n, 1.0, g)
    b = 0.2 * torch.randn(n, generator=g)
    exact = qb_update(s, b, k)
    for bins in (64, 256):
        h = MarginHistogram(b, k, bins)
        for part in s.split(1000):  # micro-batches accumulate
            h.add(part)
        assert h.counts.sum().item() == m * n
        hist = h.new_bias()
        assert (hist - exact).abs().max() < h.width, (bins, (hist - exact).abs().max(), h.width)
        assert torch.equal(hist, qb_update_hist(s, b, k, bins))
    loads_e = expert_loads(route_topk(s, exact, k), n)
    loads_h = expert_loads(route_topk(s, hist, k), n)
    assert (loads_e - loads_h).abs().max() <= 0.02 * m * k / n


def test_sign_update_by_hand():
    loads = torch.tensor([10.0, 2.0, 6.0, 6.0])  # mean 6
    b = torch.tensor([0.1, -0.2, 0.3, 0.0])
    assert torch.allclose(sign_update(loads, b, 0.01), torch.tensor([0.09, -0.19, 0.3, 0.0]))


def test_bad_inputs_raise():
    s = torch.rand(10, 4)
    with pytest.raises(ValueError, match="k=4"):
        qb_update(s, torch.zeros(4), 4)
    with pytest.raises(ValueError, match="bias shape"):
        qb_update(s, torch.zeros(5), 1)
    with pytest.raises(ValueError, match="score_range"):
        MarginHistogram(torch.zeros(4), 1).add(s * 3)
    with pytest.raises(ValueError, match="method"):
        BalanceController(torch.nn.Linear(2, 2), method="aux")


def _hist_worker(rank, world, out_dir):
    g = torch.Generator().manual_seed(7)
    s = skewed_scores(4000, 8, 1.0, g)
    b = 0.1 * torch.randn(8, generator=g)
    mine = s.chunk(world)[rank]
    torch.save(qb_update_hist(mine, b, 2, bins=128), f"{out_dir}/hist{rank}.pt")
    model = make_tiny(seed=3).train()  # the controller (and QK-clip): each rank sees half of the batch
    ctl, clip = BalanceController(model, method="qb", bins=128), QKClip(model, tau=0.09)
    ids = torch.randint(0, 4000, (4, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(input_ids=ids.chunk(world)[rank])
    stats, cstats = ctl.step(), clip.step()
    torch.save(({n: m.gate.e_score_correction_bias.clone() for n, m in ctl.layers.items()}, stats, cstats,
                {n: p.detach().clone() for n, p in model.named_parameters() if "_b_proj" in n}), f"{out_dir}/ctl{rank}.pt")


def test_all_reduced_histogram_and_qkclip_max_equal_single_process(tmp_path):
    """2 gloo ranks with half the tokens each == one process with all of them (histogram QB, the controller's
    one all_reduce, and QK-clip's MAX all_reduce so that replicas clip identically)."""
    spawn_gloo(_hist_worker, 2, str(tmp_path))
    g = torch.Generator().manual_seed(7)
    s = skewed_scores(4000, 8, 1.0, g)
    b = 0.1 * torch.randn(8, generator=g)
    single = qb_update_hist(s, b, 2, bins=128)
    for r in range(2):
        assert torch.equal(torch.load(tmp_path / f"hist{r}.pt"), single)
    model = make_tiny(seed=3).train()
    ctl, clip = BalanceController(model, method="qb", bins=128), QKClip(model, tau=0.09)
    ids = torch.randint(0, 4000, (4, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(input_ids=ids)
    stats, cstats = ctl.step(), clip.step()
    assert 0 < cstats["clipped_heads"] < 8  # some heads of the two MLA layers above τ, some not
    for r in range(2):
        biases, st, cst, weights = torch.load(tmp_path / f"ctl{r}.pt")
        for n, mod in ctl.layers.items():  # per-token router scores may differ by BLAS rounding: ~1e-7
            assert torch.allclose(biases[n], mod.gate.e_score_correction_bias, atol=1e-4), n
        assert st == pytest.approx(stats)
        assert cst["clipped_heads"] == cstats["clipped_heads"]
        assert cst["max_logit"] == pytest.approx(cstats["max_logit"], rel=1e-5)
        for n, w in weights.items():
            assert torch.allclose(w, dict(model.named_parameters())[n], rtol=1e-5, atol=1e-7), n


# ---- the controller on k3-tiny -------------------------------------------------------------------------

def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (2, 24), generator=g) for _ in range(n)]


def _routing_of(model, ids):
    """Oracle: every LatentMoE layer's (topk, scores) for this input, recorded directly."""
    from k3.model.moe import LatentMoE
    mods = {n: m for n, m in model.named_modules() if isinstance(m, LatentMoE)}
    for m in mods.values():
        m.record_routing = True
    with torch.no_grad():
        model(input_ids=ids, labels=ids)  # labels: the MTP layer (and its MoE) runs too
    return {n: m.last_routing for n, m in mods.items()}


@pytest.mark.parametrize("exact", [True, False])
def test_controller_accumulates_micro_batches_and_updates_every_layer(exact):
    model = make_tiny(seed=1).train()
    ref_model = copy.deepcopy(model)
    batches = _batches(2)
    ctl = BalanceController(model, method="qb", exact=exact, bins=256)
    assert len(ctl.layers) >= 2
    for ids in batches:  # gradient accumulation: two micro-batches, one step
        model(input_ids=ids, labels=ids).loss.backward()
    stats = ctl.step()
    recs = [_routing_of(ref_model, ids) for ids in batches]
    for n, mod in ctl.layers.items():
        ref_mod = dict(ref_model.named_modules())[n]
        old = ref_mod.gate.e_score_correction_bias
        s = torch.cat([r[n][1] for r in recs])
        want = qb_update(s, old, mod.top_k) if exact else qb_update_hist(s, old, mod.top_k, 256)
        assert torch.allclose(mod.gate.e_score_correction_bias, want, atol=1e-6), n
        assert not torch.equal(mod.gate.e_score_correction_bias, old)
        loads = sum(expert_loads(r[n][0], mod.gate.e_score_correction_bias.numel()) for r in recs)
        assert stats[n] == pytest.approx(maxvio(loads))


def test_controller_frozen_in_eval_and_checkpoint_recompute_counted_once():
    model = make_tiny(seed=2)
    ctl = BalanceController(model, method="sign", gamma=0.01)
    before = {n: m.gate.e_score_correction_bias.clone() for n, m in ctl.layers.items()}
    model.eval()
    with torch.no_grad():
        model(input_ids=_batches(1)[0])
    assert ctl.step() == {}
    assert all(torch.equal(before[n], m.gate.e_score_correction_bias) for n, m in ctl.layers.items())
    ids = _batches(1, seed=4)[0]
    loads = {}
    for ckpt in (False, True):
        model.train()
        model.gradient_checkpointing_enable(ckpt)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute whole layers, MoE hook included
            model(input_ids=ids, labels=ids).loss.backward()
        loads[ckpt] = {n: v.clone() for n, v in ctl.loads.items()}
        ctl._reset()
    assert loads[True].keys() == loads[False].keys()
    for n in loads[False]:
        assert torch.equal(loads[True][n], loads[False][n]), n
        assert loads[False][n].sum().item() == ids.numel() * ctl.layers[n].top_k


def test_controller_state_dict_resumes_mid_step():
    model = make_tiny(seed=5).train()
    batches = _batches(2, seed=6)
    twin = copy.deepcopy(model)
    ctl = BalanceController(model, method="qb", bins=64)
    with torch.no_grad():
        model(input_ids=batches[0])
    saved = copy.deepcopy(ctl.state_dict())
    with torch.no_grad():
        model(input_ids=batches[1])
    ctl.step()
    ctl2 = BalanceController(twin, method="qb", bins=64)
    ctl2.load_state_dict(saved)
    with torch.no_grad():
        twin(input_ids=batches[1])
    ctl2.step()
    for n, mod in ctl.layers.items():
        assert torch.equal(mod.gate.e_score_correction_bias, ctl2.layers[n].gate.e_score_correction_bias), n
    with pytest.raises(ValueError, match="bins"):
        BalanceController(twin, method="qb", bins=32).load_state_dict(saved)


def test_controller_sign_rule_and_qb_ema_match_the_functions():
    model = make_tiny(seed=7).train()
    ids = _batches(1, seed=8)[0]
    rec = _routing_of(copy.deepcopy(model), ids)
    for method, kw in (("sign", dict(gamma=0.01)), ("qb", dict(exact=True, ema=0.25))):
        m = copy.deepcopy(model)
        ctl = BalanceController(m, method=method, **kw)
        with torch.no_grad():
            m(input_ids=ids, labels=ids)
        ctl.step()
        for n, mod in ctl.layers.items():
            old = model.get_submodule(n).gate.e_score_correction_bias
            idx, s = rec[n]
            if method == "sign":
                want = sign_update(expert_loads(idx, old.numel()).float(), old, 0.01)
            else:
                want = 0.25 * old + 0.75 * qb_update(s, old, mod.top_k)
            assert torch.allclose(mod.gate.e_score_correction_bias, want, atol=1e-6), (method, n)
        ctl.remove()
        assert not any(mod.record_routing for mod in ctl.layers.values())
