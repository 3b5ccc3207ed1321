"""CUDA checks of the model (skipped without a GPU): CPU/GPU agreement, the fla backend inside the model,
incremental decoding and bf16-autocast training on the GPU."""

import pytest
import torch

from conftest import make_tiny, overfit_losses, rel_rmse
from k3 import K3Cache
from k3.ops.kda import fla_available

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def use_backend(model, backend: str):
    for m in model.modules():
        if hasattr(m, "backend"):
            m.backend = backend
    return model


def test_gpu_matches_cpu_fp32():
    model = use_backend(make_tiny(seed=0, vision=True), "torch")
    ids = torch.randint(0, 4000, (2, 100))
    with torch.no_grad():
        cpu = model(ids).logits
        gpu = model.cuda()(ids.cuda()).logits.cpu()
    assert rel_rmse(cpu, gpu) < 1e-5


def test_incremental_decode_on_gpu():
    model = use_backend(make_tiny(seed=1), "torch").cuda()
    ids = torch.randint(0, 4000, (2, 40), device="cuda")
    with torch.no_grad():
        full = model(ids).logits
        cache = K3Cache()
        steps = [model(ids[:, :20], past_key_values=cache, use_cache=True).logits]
        steps += [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(20, 40)]
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-4


@pytest.mark.skipif(not fla_available(), reason="fla not installed")
def test_fla_backend_inside_kda_layer_bf16():
    """The same KDA layer and bf16 input through the fla and torch backends (output and input gradient).
    Compared per layer: at the logits level, bf16 noise flips near-tied MoE top-k choices."""
    model = make_tiny(seed=2).cuda().train()
    kda = model.language_model.model.layers[1].self_attn
    x = torch.randn(2, 300, model.config.text_config.hidden_size, device="cuda")
    res = {}
    for backend in ("torch", "fla"):
        kda.backend = backend
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = kda(xi)
        y.float().square().sum().backward()
        res[backend] = (y.float(), xi.grad)
    assert rel_rmse(res["torch"][0], res["fla"][0]) < 1e-2
    assert rel_rmse(res["torch"][1], res["fla"][1]) < 2e-2


def test_bf16_autocast_training_reduces_loss():
    """k3-tiny under bf16 autocast, AdamW 3e-3, one random batch of 4 x 128 repeated 30 steps: the loss stays
    finite and falls by more than 20 %. Below about 0.74 x the start (the batch's unigram entropy, ~6.1) the curve
    is chaotic: `benchmarks/probe/autocast_loss.py` (H200, 2026-12-04) ended at 0.37 / 0.74 / 0.73 of the start
    for seeds 0 / 1 / 2 with session 19's kernels and 0.73 / 0.46 / 0.63 with session 20's (each kernel change
    alone: 0.29, 0.36), so a bound under that plateau tested the seed, not the training."""
    torch.manual_seed(0)
    model = make_tiny(seed=3).cuda().train()
    losses = overfit_losses(model, torch.randint(0, 4000, (4, 128), device="cuda"), 30, torch.bfloat16)
    assert all(map(lambda x: x == x, losses)) and losses[-1] < 0.8 * losses[0], losses


def test_grouped_mm_experts_match_the_expert_loop_bf16():
    """The no-host-sync `torch._grouped_mm` expert path (CUDA bf16) against the per-expert loop in fp32:
    outputs and the gradients of x, the routing weights and all expert weights."""
    from k3.ops import moe as moe_ops
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    g = torch.Generator(device="cuda").manual_seed(0)
    N, K, E, L, I = 512, 4, 16, 256, 128
    x = torch.randn(N, L, device="cuda", generator=g)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(N)])
    idx[:64] = 3  # a hot expert (duplicates of one expert within a token too)
    w = torch.rand(N, K, device="cuda", generator=g)
    ws = [torch.randn(E, I, L, device="cuda", generator=g) * L ** -0.5,
          torch.randn(E, L, I, device="cuda", generator=g) * I ** -0.5,
          torch.randn(E, I, L, device="cuda", generator=g) * L ** -0.5]

    def run(xx, dtype):
        leaves = [t.detach().clone().requires_grad_() for t in (xx, w, *ws)]
        xin = leaves[0].to(dtype)
        out = moe_ops.experts_forward(xin, idx, leaves[1], leaves[2], leaves[3], leaves[4])
        assert moe_ops.grouped_mm_available(xin) == (dtype == torch.bfloat16)
        out.float().pow(2).sum().backward()
        return [out.float()] + [t.grad for t in leaves]

    fast, ref = run(x, torch.bfloat16), run(x, torch.float32)
    for name, a, b in zip(["out", "dx", "dweight", "dw1", "dw2", "dw3"], fast, ref):
        assert rel_rmse(b, a) < 2e-2, (name, rel_rmse(b, a))
