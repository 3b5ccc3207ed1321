"""The model over a paged cache (the engine's one forward): `PackedBatch` indices against a per-token loop,
and packed documents continuing cached histories (decode steps, cold and continuing prefill chunks, mixed)
against the model's own full forward (k3-tiny, fp32, CPU)."""

import random

import pytest
import torch

from conftest import make_tiny
from k3.model.paged_cache import PackedBatch, PagedCache
from k3.ops.conv import CONV_TILE

TOL = 1e-4  # max |Δlogit| (fp32)
PAGE = 8  # tokens per MLA page: histories span several pages


@pytest.fixture(scope="module")
def model():
    return make_tiny(seed=21)


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_packed_batch_indices_equal_a_token_loop(device):
    """On CUDA the host-built tables travel through pinned staging (`ops._host.to_device`), expanded ones too."""
    rng = random.Random(0)
    lens, starts = [1, 1, 1, 5, 13, 1, 2], [0, 9, 30, 0, 17, 4, 8]
    W1, n = 3, len(lens)
    tables = [rng.sample(range(100), -(-(s + l) // PAGE) + rng.randrange(2)) for s, l in zip(starts, lens)]
    want = [True, False, True, True, False, True, True]
    b = PackedBatch.build(lens, starts, list(range(40, 40 + n)), tables, want, PAGE, W1, device)
    assert b.cu_seqlens.device.type == device
    assert b.num_decode == 3 and not b.decode and b.num_tokens == sum(lens)
    assert b.cu_seqlens.tolist() == [0, 1, 2, 3, 8, 21, 22, 24] and b.slots.tolist() == list(range(40, 47))
    assert b.rows.tolist() == [0, 2, 7, 21, 23]
    pages, offs, tiles, hist = [], [], [], []
    r = 0
    for j in range(n):
        tiles += [[j, t] for t in range(r, r + lens[j], CONV_TILE)]
        r += lens[j]
        for p in range(starts[j], starts[j] + lens[j]):
            pages.append(tables[j][p // PAGE])
            offs.append(p % PAGE)
        if j >= 3:
            hist += [(tables[j][p // PAGE], p % PAGE) for p in range(starts[j] + lens[j])]
    assert b.tok_page.tolist() == pages and b.tok_off.tolist() == offs
    assert b.conv_tiles.tolist() == tiles
    assert list(zip(b.hist_page.tolist(), b.hist_off.tolist())) == hist
    assert b.hist_cu == [0, 5, 35, 40, 50]
    for j in range(3):  # decode rows: history [0, start] of each single-token document, padded
        S = starts[j] + 1
        assert b.dec_valid[j].tolist() == [True] * S + [False] * (b.dec_valid.shape[1] - S)
        got = list(zip(b.dec_page[j, :S].tolist(), b.dec_off[j, :S].tolist()))
        assert got == [(tables[j][p // PAGE], p % PAGE) for p in range(S)]


def test_packed_batch_rejects_bad_documents():
    with pytest.raises(ValueError, match="1 token"):
        PackedBatch.build([2, 0], [0, 0], [0, 1], [[0], [1]], [True, True], PAGE, 3, "cpu")
    with pytest.raises(ValueError, match="more pages"):
        PackedBatch.build([5], [6], [0], [[0]], [True], PAGE, 3, "cpu")
    with pytest.raises(ValueError, match="start, slot"):
        PackedBatch.build([5], [0, 1], [0], [[0]], [True], PAGE, 3, "cpu")


class Pool:
    """A bare paged pool (plain tensors; the engine's PagePool has the same typed views). MLA rows start as
    NaN, so a row read before it was written poisons the logits."""

    def __init__(self, model, pages: int = 64):
        lm = model.language_model
        dev = lm.lm_head.weight.device
        cfg = lm.config
        layers = lm.model.decoder_layers
        kda = [l.layer_idx for l in layers if l.is_kda]
        mla = [l.layer_idx for l in layers if not l.is_kda]
        la = cfg.linear_attn_config
        H, K, W = la.num_heads, la.head_dim, la.short_conv_kernel_size
        self.state = torch.zeros(pages, len(kda), H, K, K, device=dev)
        self.conv = torch.zeros(pages, len(kda), 3, H * K, W - 1, device=dev)
        self.mla = torch.full((pages, len(mla), PAGE, cfg.kv_lora_rank + cfg.qk_rope_head_dim), float("nan"),
                              device=dev)
        self.cache = PagedCache(self.state, self.conv, self.mla, kda, mla)
        self.lm = lm

    @torch.no_grad()
    def forward(self, docs):
        """docs: (tokens, start, slot, pages) → logits [n, V] at each document's last token."""
        b = PackedBatch.build([len(d[0]) for d in docs], [d[1] for d in docs], [d[2] for d in docs],
                              [d[3] for d in docs], [True] * len(docs), PAGE, self.conv.shape[-1],
                              self.conv.device)
        self.cache.batch = b
        ids = torch.tensor([t for d in docs for t in d[0]], device=self.conv.device)
        _, hn, _ = self.lm.model(self.lm.model.embed_tokens(ids)[None], cache=self.cache, rows=b.rows)
        return self.lm.lm_head(hn)[0]


def check_packed_documents(model):
    """Five sequences advanced by packed forwards of every kind; each document's last-token logits against the
    model's own forward over the whole sequence."""
    rng = random.Random(1)
    n = 5
    dev = model.language_model.lm_head.weight.device
    seqs = [[rng.randrange(4000) for _ in range(rng.randrange(30, 45))] for _ in range(n)]
    with torch.no_grad():
        full = [model(torch.tensor([s], device=dev)).logits[0] for s in seqs]
    pool = Pool(model)
    free = list(range(pool.mla.shape[0]))
    rng.shuffle(free)
    slots = [free.pop() for _ in range(n)]
    tables = [[free.pop() for _ in range(-(-len(s) // PAGE))] for s in seqs]
    done = [0] * n

    def step(plan):  # plan: (sequence, number of new tokens); single tokens first
        docs = [(seqs[i][done[i]:done[i] + m], done[i], slots[i], tables[i]) for i, m in plan]
        logits = pool.forward(docs)
        for (i, m), lg in zip(plan, logits):
            done[i] += m
            assert (lg - full[i][done[i] - 1]).abs().max() <= TOL, (i, done[i])

    step([(0, 1), (1, 7), (2, 12)])  # a cold single token, cold chunks (all start at 0)
    step([(0, 1), (1, 1), (2, 1)])  # pure decode (one-step KDA, absorbed MLA)
    step([(0, 9), (3, 20), (1, 3)])  # continuing chunks crossing pages + a cold one
    step([(2, 1), (3, 1), (0, 1), (1, 1)])
    step([(0, 1), (4, 5), (2, 8), (3, 2)])  # mixed: a decode, then chunks
    for _ in range(3):
        step([(i, 1) for i in range(n)])
    assert min(done) >= 8 and max(done) > 2 * PAGE


def test_packed_documents_over_pages_equal_the_full_forward(model, one_thread):
    check_packed_documents(model)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_packed_documents_equal_the_full_forward():
    """The CUDA kernels of the one forward (the Triton short conv in token tiles from the pool's windows,
    chunk_kda_gated with initial states, the Triton decode step) against the model's own CUDA forward, fp32
    without TF32."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        check_packed_documents(make_tiny(seed=21).cuda())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_paged_cache_rejects_bad_use(model):
    pool = Pool(model)
    with pytest.raises(RuntimeError, match="batch"):
        pool.cache.layer(0)
    with pytest.raises(ValueError, match="KDA"):
        PagedCache(pool.state, pool.conv, pool.mla, [0], [])
    pool.cache.batch = PackedBatch.build([2], [0], [0], [[1]], [True], PAGE, pool.conv.shape[-1], "cpu")
    attn = model.language_model.model.layers[0].self_attn
    x = torch.randn(1, 2, model.config.text_config.hidden_size)
    with pytest.raises(ValueError, match="paged cache"):
        attn(x, attention_mask=torch.ones(1, 2), cache=pool.cache.layer(0))
