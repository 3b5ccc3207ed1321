"""`k3.ops.page_ops`: the Triton kernel (interpreter on CPU, CUDA where present) equals the PyTorch reference, which
equals plain slicing; bad tables are refused."""
import random

import pytest
import torch

from k3.ops.page_ops import apply_page_ops, page_ops_reference, table_of, table_words, triton_available


def _segments(rng: random.Random, size: int, k: int) -> list[tuple[int, int, int]]:
    """k segments: destinations disjoint ranges of the first half of [0, size), sources (or -1, a zero-fill)
    anywhere in the second half, so no segment reads or writes another's destination."""
    half, cuts = size // 2, sorted(rng.sample(range(1, size // 2), 2 * k))
    segs = []
    for a, b in zip(cuts[::2], cuts[1::2]):
        n = min(b - a, 3000)
        segs.append((rng.randrange(half, size - n) if rng.random() < 0.8 else -1, a, n))
    return segs


def _table(segs, room: int, device="cpu") -> torch.Tensor:
    t = torch.zeros(table_words(room), dtype=torch.long)
    t[:1 + 3 * len(segs)] = torch.tensor(table_of(segs))
    return t.to(device)


def _sliced(words: torch.Tensor, segs) -> torch.Tensor:
    out = words.clone()
    for src, dst, n in segs:
        out[dst:dst + n] = words[src:src + n] if src >= 0 else 0
    return out


@pytest.mark.parametrize("seed", range(4))
def test_reference_equals_slicing(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2 ** 62, 2 ** 62, (40_000,), generator=g)
    segs = _segments(rng, words.numel(), rng.randrange(0, 6))
    want = _sliced(words, segs)
    page_ops_reference(words, _table(segs, 8))
    assert torch.equal(words, want)


@pytest.mark.skipif(not triton_available(), reason="triton not importable")
@pytest.mark.parametrize("seed", range(3))
def test_triton_equals_the_reference(seed):
    """Fresh random words (never zeros, so a zero-fill shows), 0-5 segments of 1-3,000 words (a partial last block,
    single words), room for more in the table: the kernel's result equals the reference's, bitwise."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        from k3.ops.page_ops_triton import page_ops_kernel
        from k3.ops._triton import interpreted
        if not interpreted(page_ops_kernel):
            pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    rng = random.Random(100 + seed)
    g = torch.Generator().manual_seed(100 + seed)
    words = torch.randint(-2 ** 62, 2 ** 62, (30_000,), generator=g)
    while (words == 0).any():
        words[words == 0] = 1
    segs = _segments(rng, words.numel(), [0, 1, 5][seed])
    want = words.clone()
    page_ops_reference(want, _table(segs, 6))
    got = words.clone().to(device)
    apply_page_ops(got, _table(segs, 6, device), backend="triton")
    assert torch.equal(got.cpu(), want)
    assert segs == [] or not torch.equal(want, words)


def test_bad_inputs():
    w = torch.zeros(10, dtype=torch.long)
    with pytest.raises(ValueError, match="words must be a contiguous 1-D int64"):
        apply_page_ops(w.int(), _table([], 1))
    with pytest.raises(ValueError, match="table holds 1 \\+ 3·S words"):
        apply_page_ops(w, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="backend must be"):
        apply_page_ops(w, _table([], 1), backend="cuda")
