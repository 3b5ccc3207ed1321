"""`k3.ops.kda_block` (a batch-1 decode step's KDA attention as one persistent kernel) against the composed ops it
replaces (`linear`, `short_conv_step`, `kda_decode_step_gated`, the gated norm in `linear`'s prologue): the output,
the slot's conv window and recurrent state, the other slots untouched; its checks; an engine with it (and / or the MoE
block) on against the engine without. CPU: Triton's interpreter, one program, fp32; CUDA: every SM's programs."""

import random

import pytest
import torch

from conftest import make_tiny, rel_rmse
from k3.ops import kda_block, moe_block
from k3.ops.kda_block import kda_block_decode, kda_block_reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _device_or_skip() -> str:
    if torch.cuda.is_available():
        return "cuda"
    kda_block.ON, on = True, kda_block.ON
    try:
        with torch.no_grad():
            usable = kda_block.fits(torch.zeros(1, 16), 16)
        if not usable:
            pytest.skip("needs CUDA or Triton's interpreter")
    finally:
        kda_block.ON = on
    return "cpu"


def _inputs(D, H, K, W, P, dtype, device, seed, bias=True):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)
    HK = H * K
    return dict(
        x=r(1, D), w_in=r(4 * HK + K + H + 5, D, s=D ** -0.5), w_fb=r(HK, K, s=K ** -0.5),
        w_conv=(0.5 * torch.randn(3 * HK, 1, W, generator=g)).to(device),
        conv_pool=r(P, 3 * HK, W - 1), state_pool=(0.1 * torch.randn(P, H, K, K, generator=g)).to(device),
        slot=torch.tensor([P - 2], device=device), A_log=(0.3 * torch.randn(H, generator=g)).to(device),
        dt_bias=(0.5 * torch.randn(HK, generator=g)).to(device) if bias else None, lower_bound=-5.0,
        o_norm=((1 + 0.1 * torch.randn(K, generator=g)).to(device=device, dtype=dtype), 1e-6), w_o=r(D, HK, s=HK ** -0.5),
        residual=r(1, D), counters=torch.zeros(3, dtype=torch.int32, device=device))


def _composed(a):
    """The engine's decode branch for one sequence, op by op, on the pools given (updated in place)."""
    return kda_block_reference(**a)


@pytest.mark.parametrize("shape", [(64, 2, 16, 4), (96, 3, 32, 4), (64, 2, 16, 3)])  # D, H, K, W
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tiles", [{}, dict(mma=True, bn=16, ch=32)], ids=["sums", "mma"])
def test_block_equals_the_composed_ops(shape, bias, tiles, monkeypatch):
    """Both tile forms of the projections: fp32 sums, and 16-row tiles on the tensor cores (IEEE fp32 here)."""
    dev = _device_or_skip()
    monkeypatch.setattr(kda_block, "LAUNCH", {**kda_block.LAUNCH, **tiles})
    D, H, K, W = shape
    a = _inputs(D, H, K, W, 4, torch.float32, dev, seed=sum(shape), bias=bias)
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    with torch.no_grad():
        want = _composed(a)
        got = kda_block_decode(**b)
    assert rel_rmse(got, want) <= 1e-5
    # the window: shifted by one (exact copies), the new token's projection appended (its own fp32 sum order)
    assert torch.equal(b["conv_pool"][..., :-1], a["conv_pool"][..., :-1])
    assert rel_rmse(b["conv_pool"], a["conv_pool"]) <= 1e-6
    assert rel_rmse(b["state_pool"], a["state_pool"]) <= 1e-6
    assert b["counters"].tolist() == [0, 0, 0]
    # the other slots: untouched
    fresh = _inputs(D, H, K, W, 4, torch.float32, dev, seed=sum(shape), bias=bias)
    keep = [i for i in range(4) if i != 2]
    assert torch.equal(b["conv_pool"][keep], fresh["conv_pool"][keep])
    assert torch.equal(b["state_pool"][keep], fresh["state_pool"][keep])


def test_block_rejects_bad_inputs():
    dev = _device_or_skip()
    a = _inputs(64, 2, 16, 4, 3, torch.float32, dev, seed=1)
    bad = [("x", torch.randn(2, 64, device=dev), "one contiguous row"), ("w_fb", a["w_fb"][:, :15], "w_fb"),
           ("w_in", a["w_in"][:100], "w_in"), ("A_log", a["A_log"][:1], "A_log"),
           ("state_pool", a["state_pool"].double(), "state_pool"), ("conv_pool", a["conv_pool"][:, :10], "conv_pool"),
           ("slot", torch.tensor([0.5], device=dev), "slot"), ("residual", a["residual"][:, :10], "residual"),
           ("counters", torch.zeros(2, device=dev), "counters"), ("dt_bias", torch.zeros(3, device=dev), "dt_bias")]
    for name, value, msg in bad:
        with pytest.raises(ValueError, match=msg):
            kda_block_decode(**{**a, name: value})


@pytest.mark.parametrize("blocks", [("moe",), ("kda", "moe")])
def test_engine_with_decode_blocks_equals_the_engine_without(blocks, monkeypatch):
    """Greedy decoding at batch 1 (the blocks' steps) and a batch of three (the composed path) in fp32, with the
    given persistent blocks on against all off: the same tokens, logits within fp32 rounding; each block ran."""
    dev = _device_or_skip()
    from k3.serve import Engine, EngineConfig, SamplingParams

    model = make_tiny(seed=8).to(dev)
    rng = random.Random(8)
    prompts = [[rng.randrange(4000) for _ in range(rng.randrange(3, 40))] for _ in range(4)]
    mods = {"kda": (kda_block, "kda_block_decode"), "moe": (moe_block, "moe_block_decode")}
    calls = {b: [] for b in mods}
    for b, (mod, fn) in mods.items():
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, real=real, b=b, **k: calls[b].append(1) or real(*a, **k))
    runs = []
    for on in (False, True):
        for b, (mod, _) in mods.items():
            monkeypatch.setattr(mod, "ON", on and b in blocks)
        eng = Engine(model, EngineConfig(block_size=32, hash_block_size=16, num_pages=64, record_logits=True))
        sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        outs = eng.generate(prompts[:1], sp) + eng.generate(prompts[1:], sp)
        runs.append((outs, eng))
        assert {b: bool(c) for b, c in calls.items()} == {b: on and b in blocks for b in mods}
        eng.check_pool()
    (oa, ea), (ob, eb) = runs
    for a, b in zip(oa, ob):
        assert a.token_ids == b.token_ids
        for u, v in zip(ea.recorded_logits[a.request_id], eb.recorded_logits[b.request_id]):
            assert (u - v).abs().max() <= 1e-4


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("coop,tiles", [(False, {}), (True, {}), (True, dict(mma=True, bn=16))],
                         ids=["plain-launch", "cooperative-launch", "cooperative-mma"])
def test_cuda_block_at_k3_small_width_and_in_a_graph(coop, tiles, monkeypatch):
    """k3-small's KDA dimensions (D 1,536, 12 heads of 128, conv 4), bf16, every SM's programs: the composed ops'
    output within bf16 rounding, the window equal, the state within fp32 rounding of bf16 inputs; a CUDA graph of
    the kernel replayed equals an eager run from the same pools, bitwise; launched plainly and as a cooperative
    grid."""
    monkeypatch.setattr(kda_block, "LAUNCH", {**kda_block.LAUNCH, "coop": coop, **tiles})
    a = _inputs(1536, 12, 128, 4, 6, torch.bfloat16, "cuda", seed=9)
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    with torch.no_grad():
        want = _composed(a)
        got = kda_block_decode(**b)
    assert rel_rmse(got.float(), want.float()) <= 1e-2
    assert torch.equal(b["conv_pool"][..., :-1], a["conv_pool"][..., :-1])
    assert rel_rmse(b["conv_pool"].float(), a["conv_pool"].float()) <= 1e-2
    assert rel_rmse(b["state_pool"], a["state_pool"]) <= 1e-2
    c = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    eager = kda_block_decode(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c.items()})
    graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        out = kda_block_decode(**c)
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
