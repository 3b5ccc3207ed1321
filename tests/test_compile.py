"""Regional torch.compile of the decoder layers (what `benchmarks/train_throughput.py --compile` does): the ops
are opaque to dynamo (`k3.ops._compile.eager_op`: their own kernels and host checks run as they are), so a
compiled training step gives the eager step's loss and gradients and, after the first step, compiles nothing
new (no guard on data: expert counts, document bounds). Backend aot_eager (dynamo + AOT autograd, no C++
toolchain needed); the GPU run uses inductor."""

import pytest
import torch

from conftest import make_tiny

torch_dynamo = pytest.importorskip("torch._dynamo")


def compiled_layers(model):
    for m in model.modules():
        if type(m).__name__ in ("KimiDecoderLayer", "MTPLayer") and hasattr(m, "forward_attn_res"):
            m.forward_attn_res = torch.compile(m.forward_attn_res, dynamic=False, backend="aot_eager")
    return model


def step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_layers_equal_eager_and_do_not_recompile():
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    old = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = 64  # one graph per layer variant (index, AttnRes block position)
    try:
        eager = make_tiny(seed=0).train()
        comp = compiled_layers(make_tiny(seed=0).train())
        g = torch.Generator().manual_seed(0)
        graphs = []
        for _ in range(3):
            ids = torch.randint(0, 4000, (2, 48), generator=g)  # fresh tokens: fresh routing every step
            (le, ge), (lc, gc) = step(eager, ids), step(comp, ids)
            torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
            assert ge.keys() == gc.keys() and len(ge) > 20
            for n in ge:
                torch.testing.assert_close(gc[n], ge[n], rtol=1e-4, atol=1e-6, msg=n)
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs[0] > 0 and graphs[1] == graphs[0] and graphs[2] == graphs[0], graphs
    finally:
        torch._dynamo.config.cache_size_limit = old
        torch._dynamo.reset()
