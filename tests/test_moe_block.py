"""`k3.ops.moe_block` (a batch-1 decode step's whole LatentMoE as one persistent kernel) against the composed path it
replaces (`LatentMoE.forward`'s joined inference branch with the switch off): outputs, routing, scores; its checks;
its barrier counters left at zero; an engine with it against the engine without. On a CPU the kernel runs in
Triton's interpreter with one program; on CUDA with every SM's programs and grid barriers, also in a CUDA graph."""

import random

import pytest
import torch
import triton
import triton.language as tl

from conftest import make_tiny, rel_rmse
from k3.ops import moe_block
from k3.ops._triton_jit import grid_barrier, grid_done
from k3.ops.moe_block import moe_block_decode

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _device_or_skip() -> str:
    if torch.cuda.is_available():
        return "cuda"
    probe = torch.zeros(1, 4)
    if not moe_block.available(probe):
        pytest.skip("needs CUDA or Triton's interpreter")
    return "cpu"


def _moe(seed: int, dtype: torch.dtype, device: str, bias: bool = True, **over):
    """A LatentMoE of k3-tiny (its layer 1), weights and selection bias random."""
    model = make_tiny(seed=seed, **over).to(device=device, dtype=dtype)
    moe = model.language_model.model.layers[1].block_sparse_moe
    if bias:
        g = torch.Generator().manual_seed(seed)
        moe.gate.e_score_correction_bias.copy_(0.05 * torch.randn(moe.gate.e_score_correction_bias.shape, generator=g))
    return moe


def _both(moe, x, residual, monkeypatch):
    """(composed path, block kernel): (output, topk_idx, scores) of one row."""
    outs = []
    for on in (False, True):
        monkeypatch.setattr(moe_block, "ON", on)
        moe.record_routing = True
        with torch.no_grad():
            y = moe(x, residual=None if residual is None else residual.clone())
        outs.append((y, *moe.last_routing))
    return outs


# bf16 on CUDA only: Triton's CPU interpreter rounds fp32 → bf16 toward zero (half of all values differ from
# round-to-nearest-even, all toward zero: measured on 65,536 normals), which biases the kernel's five roundings
# (≈ 1.6e-2 against the composed path there, 5e-3 between exact-rounding paths)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6),
                                       pytest.param(torch.bfloat16, 1e-2, marks=[cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("split", [False, True], ids=["one-launch", "split"])
def test_block_equals_the_composed_path(dtype, tol, residual, split, monkeypatch):
    """split: the four phases as four launches, a program per tile (so several programs under the interpreter)."""
    dev = _device_or_skip()
    monkeypatch.setattr(moe_block, "SPLIT", split)
    for seed in (0, 1, 2):
        moe = _moe(seed, dtype, dev)
        g = torch.Generator().manual_seed(100 + seed)
        D = moe.routed_expert_up_proj.weight.shape[0]
        x = torch.randn(1, 1, D, generator=g).to(device=dev, dtype=dtype)
        res = torch.randn(1, 1, D, generator=g).to(device=dev, dtype=dtype) if residual else None
        (ya, ia, sa), (yb, ib, sb) = _both(moe, x, res, monkeypatch)
        assert yb.shape == ya.shape and yb.dtype == ya.dtype
        assert torch.equal(ia.reshape(-1).cpu(), ib.reshape(-1).cpu()), (ia, ib)
        assert rel_rmse(sb.float(), sa.float()) <= 1e-6
        assert rel_rmse(yb.float(), ya.float()) <= tol, rel_rmse(yb.float(), ya.float())


def test_block_without_norm_or_bias_and_other_top_k(monkeypatch):
    dev = _device_or_skip()
    for over in (dict(latent_moe_use_norm=False), dict(num_experts_per_token=1), dict(moe_renormalize=False,
                                                                                     routed_scaling_factor=2.5)):
        moe = _moe(3, torch.float32, dev, bias=False, **over)
        g = torch.Generator().manual_seed(3)
        x = torch.randn(1, moe.routed_expert_up_proj.weight.shape[0], generator=g).to(dev)
        (ya, ia, _), (yb, ib, _) = _both(moe, x, None, monkeypatch)
        assert torch.equal(ia.cpu(), ib.cpu()) and rel_rmse(yb, ya) <= 2e-6, over


def test_split_block_with_other_tiles_per_phase(monkeypatch):
    """The split form with different row tiles in each phase (phase 1's last tile ragged: k3-tiny's 328 joined
    input rows in tiles of 16) equals the composed path in fp32."""
    dev = _device_or_skip()
    monkeypatch.setattr(moe_block, "SPLIT", True)
    for k, v in dict(bn1=16, bn2=2, bn4=8, bi=8, bl=2).items():
        monkeypatch.setitem(moe_block.LAUNCH_SPLIT, k, v)
    moe = _moe(5, torch.float32, dev)
    x = torch.randn(1, moe.routed_expert_up_proj.weight.shape[0], generator=torch.Generator().manual_seed(5)).to(dev)
    (ya, ia, _), (yb, ib, _) = _both(moe, x, None, monkeypatch)
    assert torch.equal(ia.cpu(), ib.cpu()) and rel_rmse(yb, ya) <= 2e-6


def test_block_leaves_its_counters_at_zero_and_takes_one_row_only(monkeypatch):
    dev = _device_or_skip()
    moe = _moe(4, torch.float32, dev)
    monkeypatch.setattr(moe_block, "ON", True)
    monkeypatch.setattr(moe_block, "SPLIT", False)  # the one launch: the form with barriers and counters
    D = moe.routed_expert_up_proj.weight.shape[0]
    with torch.no_grad():
        moe(torch.randn(1, D, device=dev))
        (cnt,) = moe.__dict__["_grid_counters"].values()  # keyed by the device with its index (cuda:0)
        assert cnt.tolist() == [0, 0, 0]
        cnt.fill_(7)  # two rows: the composed path, which does not touch the counters
        moe(torch.randn(2, D, device=dev))
        assert cnt.tolist() == [7, 7, 7]


def test_engine_with_the_block_equals_the_engine_without(monkeypatch):
    """Greedy decoding at batch 1 (the block's steps) and a batch of three (the composed path) in fp32, with the
    block on against off: the same tokens, logits within fp32 rounding; the block ran only when on."""
    dev = _device_or_skip()
    from k3.serve import Engine, EngineConfig, SamplingParams

    model = make_tiny(seed=8).to(dev)
    rng = random.Random(8)
    prompts = [[rng.randrange(4000) for _ in range(rng.randrange(3, 40))] for _ in range(4)]
    calls, real = [], moe_block.moe_block_decode
    monkeypatch.setattr(moe_block, "moe_block_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    runs = []
    for on in (False, True):
        monkeypatch.setattr(moe_block, "ON", on)
        eng = Engine(model, EngineConfig(block_size=32, hash_block_size=16, num_pages=64, record_logits=True))
        sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        outs = eng.generate(prompts[:1], sp) + eng.generate(prompts[1:], sp)
        runs.append((outs, eng))
        assert bool(calls) == on
        eng.check_pool()
    (oa, ea), (ob, eb) = runs
    for a, b in zip(oa, ob):
        assert a.token_ids == b.token_ids
        for u, v in zip(ea.recorded_logits[a.request_id], eb.recorded_logits[b.request_id]):
            assert (u - v).abs().max() <= 1e-4


def test_block_rejects_bad_inputs():
    dev = _device_or_skip()
    moe = _moe(5, torch.float32, dev)
    sh, ex = moe.shared_experts, moe.experts
    D, L, IS = moe.routed_expert_up_proj.weight.shape[0], ex.w1.shape[2], sh.gate_proj.weight.shape[0]
    E = ex.w1.shape[0]
    w_in = torch.randn(L + 2 * IS + E, D, device=dev)
    cnt = torch.zeros(3, dtype=torch.int32, device=dev)
    args = dict(x=torch.randn(1, D, device=dev), w_in=w_in, latent=L, shared=IS, w1=ex.w1, w2=ex.w2, w3=ex.w3,
                w_shared_down=sh.down_proj.weight, w_up=moe.routed_expert_up_proj.weight, norm=None, bias=None,
                top_k=2, renormalize=True, scaling_factor=1.0, beta=4.0, linear_beta=25.0, residual=None,
                counters=cnt)
    bad = [("x", torch.randn(2, D, device=dev), "one row"), ("w_in", w_in[1:], "w_in has shape"),
           ("latent", L + 1, "latent="), ("top_k", E + 1, "top_k"), ("bias", torch.zeros(E, device=dev,
                                                                                        dtype=torch.float64), "bias"),
           ("residual", torch.randn(1, D + 1, device=dev), "residual"),
           ("counters", torch.zeros(2, dtype=torch.int32, device=dev), "counters"),
           ("norm", (torch.ones(L + 1, device=dev), 1e-6), "norm weight")]
    for name, value, msg in bad:
        with pytest.raises(ValueError, match=msg):
            moe_block_decode(**{**args, name: value})


def test_cooperative_launch_keywords():
    """`LAUNCH["coop"]` asks the driver for a cooperative grid on CUDA only (the interpreter runs programs in turn)."""
    from k3.ops._triton import cooperative
    assert cooperative(torch.zeros(1), True) == {} and cooperative(torch.zeros(1), False) == {}
    if torch.cuda.is_available():
        assert cooperative(torch.zeros(1, device="cuda"), True) == {"launch_cooperative_grid": True}


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("coop,split", [(False, False), (True, False), (True, True)],
                         ids=["plain-launch", "cooperative-launch", "split"])
def test_cuda_block_at_k3_small_width_and_in_a_graph(coop, split, monkeypatch):
    """k3-small's MoE dimensions, bf16, every SM's programs (the barriers for real): the composed path's output
    within bf16 rounding, the same experts; a CUDA graph of the kernel replayed equals its eager run, bitwise;
    launched plainly, as a cooperative grid, and split into four launches (no barriers)."""
    monkeypatch.setitem(moe_block.LAUNCH, "coop", coop)
    monkeypatch.setattr(moe_block, "SPLIT", split)
    from k3.config import K3Config
    from k3.model.moe import LatentMoE
    cfg = K3Config.preset("k3-small").text_config
    torch.manual_seed(7)
    moe = LatentMoE(cfg).cuda()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    moe = moe.to(torch.bfloat16).eval()
    x = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    (ya, ia, _), (yb, ib, _) = _both(moe, x, res, monkeypatch)
    assert torch.equal(ia, ib) and rel_rmse(yb.float(), ya.float()) <= 1.5e-2
    monkeypatch.setattr(moe_block, "ON", True)
    with torch.no_grad():
        eager = moe(x, residual=res.clone())
        graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(graph):
            out = moe(x, residual=res.clone())
        torch.cuda.current_stream().wait_stream(s)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert moe.__dict__["_grid_counters"][torch.device("cuda", torch.cuda.current_device())].tolist() == [0, 0, 0]


@triton.jit
def _two_phases(x_ptr, cnt_ptr, G, SPINS: tl.constexpr):
    """Each program stores its value, meets the others at a barrier, then reads its neighbour's."""
    p = tl.program_id(0)
    tl.store(x_ptr + p, p + 1.0)
    grid_barrier(cnt_ptr, G, SPINS)
    tl.store(x_ptr + G + p, tl.load(x_ptr + (p + 1) % G, cache_modifier=".cg"))
    grid_done(cnt_ptr, G)


def test_grid_barrier_flags_a_wait_that_times_out():
    """`grid_barrier`: two programs in the interpreter run one after the other, so the first waits at its barrier
    for a program that has not started: the wait must end after SPINS polls with cnt[2] set (a flagged wrong
    result, not a hung GPU); one program passes with the counters back at zero."""
    _device_or_skip()
    if torch.cuda.is_available():
        pytest.skip("the interpreter's sequential programs are what makes a wait time out here")
    for G, flagged in ((1, 0), (2, 1)):
        x, cnt = torch.zeros(2 * G), torch.zeros(3, dtype=torch.int32)
        _two_phases[(G,)](x, cnt, G, SPINS=4)
        assert cnt.tolist() == [0, 0, flagged]
    assert x.tolist()[:2] == [1.0, 2.0] and x.tolist()[2] == 0.0  # program 0 read program 1's value too early
