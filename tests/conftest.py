import os
import random

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's CPU interpreter. Triton binds its own language helpers
# (tl.zeros, ...) to the interpreter or the compiler when it is first imported, so the choice is made here,
# before any test module imports it, and not by whichever test happens to run first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3 import K3Config, K3ForConditionalGeneration


@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (10x under CPU contention)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel_rmse(ref: torch.Tensor, x: torch.Tensor) -> float:
    """‖ref − x‖₂ / ‖ref‖₂ in fp64 (fla's metric), on ref's device (a CPU reference against a GPU result)."""
    ref, x = ref.double(), x.double().to(ref.device)
    return ((ref - x).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="session")
def tiny_config() -> K3Config:
    return K3Config.preset("k3-tiny")


def make_tiny(seed: int = 0, vision: bool = False, **text_overrides) -> K3ForConditionalGeneration:
    cfg = K3Config.preset("k3-tiny")
    if not vision:
        cfg.vision_config = None
    for k, v in text_overrides.items():
        setattr(cfg.text_config, k, v)
    torch.manual_seed(seed)
    model = K3ForConditionalGeneration(cfg)
    randomize(model, seed)
    return model.eval()


def overfit_losses(model, ids: torch.Tensor, steps: int, autocast: torch.dtype | None = None) -> list[float]:
    """The LM loss of each of `steps` AdamW (lr 3e-3) steps of `model` on the one batch `ids` (labels = ids, plus
    0.1 x the MTP loss in the objective), under `autocast` on ids' device when given."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        with torch.autocast(ids.device.type, dtype=autocast, enabled=autocast is not None):
            out = model(ids, labels=ids)
        loss = out.loss + 0.1 * out.mtp_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return losses


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    """n prompts of random k3-tiny token ids (below its special ids), lengths in [lo, hi)."""
    g = random.Random(seed)
    return [[g.randrange(0, 4000) for _ in range(g.randrange(lo, hi))] for _ in range(n)]


@torch.no_grad()
def randomize(model, seed: int = 0) -> None:
    """Give zero-initialised parameters (AttnRes queries, router bias) random values so tests exercise them."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("_res_proj.weight"):
            t.copy_(torch.randn(t.shape, generator=g) * 0.5)
        elif name.endswith("e_score_correction_bias"):
            t.copy_(torch.randn(t.shape, generator=g) * 0.05)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))


def full_grad(t, name: str, ep_group):
    """A (sharded) parameter or gradient of a distributed model as the full single-process tensor: FSDP2 shards
    gathered (`full_tensor`), then a routed expert tensor's E/ep home rows all-gathered over `ep_group`."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    t = t.full_tensor() if isinstance(t, DTensor) else t
    if ".experts.w" in name and dist.get_world_size(ep_group) > 1:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
        dist.all_gather(parts, t.contiguous(), group=ep_group)
        t = torch.cat(parts)
    return t


@pytest.fixture
def nan_empty(monkeypatch):
    """`torch.empty` returning NaN-filled float tensors for the test's duration: output rows a kernel must write
    (zeros for a captured step's padding rows) cannot pass by the allocator's luck (fresh CPU memory is zero)."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t
    monkeypatch.setattr(torch, "empty", empty)


def assert_same_batch(ref, got, skip_last: tuple[str, ...] = ()) -> None:
    """Every field of two `PackedBatch`es equal (tensors by value in int64, tuples of tensors element-wise); the
    fields in `skip_last` compared without their last entry."""
    for name in ref.__dataclass_fields__:
        x, y = getattr(ref, name), getattr(got, name)
        if name in skip_last:
            x, y = x[:-1], y[:-1]
        if isinstance(x, tuple):
            assert all(torch.equal(u.long(), v.long()) for u, v in zip(x, y)), name
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x.long(), y.long()), name
        else:
            assert x == y, name
