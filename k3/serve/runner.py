"""Model execution over the paged pool: the runner only builds metadata and calls the model.

One forward is one packed row [1, N] of documents (decode tokens first, then prefill chunks), each continuing
its sequence's cached history: `PackedBatch` holds the index tensors (cu_seqlens, start positions, KDA slots,
MLA pages, conv-window layout, which rows want logits) and `PagedCache` lets the model's own KDA / MLA modules
read and update the pool. The runner embeds the ids, runs `lm.model` and applies the LM head to the wanted
rows only. No layer logic lives here (see k3/model/paged_cache.py).

Pure decode steps of a bf16 model on CUDA replay CUDA graphs (`DecodeGraph`), captured lazily per (batch bucket, history
bucket): the batch is padded to the bucket with entries that point at two scratch pages the runner reserves
(a KDA slot and an MLA page), its metadata is built on the device from one int64 buffer (`PackedBatch.for_decode`),
and one host→device copy of that buffer is all a step sends. Steps of short chunks (prefix-hit tails, short
prompts, decodes beside them) replay `ExtendGraph`s, captured per (token bucket, sequence bucket, history
bucket): KDA steps through each chunk recurrently and MLA reads each token's history from the pages, so no
shape depends on the chunk lengths. A longer prefill chunk alone in a step (a new request on a quiet
server, each chunk of a long prompt) replays a `PrefillGraph`, captured per (token bucket, history bucket,
checkpoint bucket): the chunked KDA kernels and causal attention over the history and the chunk, over device-built
tables. Other steps (chunks beside other work, batches or histories past the largest bucket) run eagerly.
"""

from __future__ import annotations

import bisect
import itertools
import os
from array import array
from dataclasses import dataclass

import numpy as np
import torch

from ..model.paged_cache import PackedBatch, PagedCache, prefill_tables_host, token_runs_host
from ..ops import gemv
from ..ops._host import to_device
from ..ops.attn_res import static_tables
from ..ops.conv import CONV_TILE
from ..ops.kda import STATES_AT_MULTIPLE
from ..ops.moe import grouped_mm_available
from ..ops.page_ops import apply_page_ops, table_of, table_words, triton_available as page_ops_triton
from .pool import PagePool, PoolExhausted

# whether the extend and prefill graphs take their run tables (and a prefill's checkpoint table and conv tiles) from
# the host with their inputs (`token_runs_host`, `prefill_tables_host`) or (K3_GRAPH_HOST_TABLES=0) build them
# inside the captured forward (≈ 50 / 35 small kernels); `benchmarks/serve.py` flips it in the same run
HOST_TABLES = os.environ.get("K3_GRAPH_HOST_TABLES", "1") == "1"
# whether an extend graph runs the pool copies of its step's admissions (a prefix hit's KDA checkpoint into the
# sequence's slot, a shared MLA page's rows into its own) as its first kernel (`k3.ops.page_ops`, from a table in
# its inputs) rather than as host calls before it (`PagePool.defer`); read when a graph is captured
GRAPH_COPIES = os.environ.get("K3_GRAPH_COPIES", "1") == "1"

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MIN_HISTORY = 256          # smallest padded MLA history of a decode graph (then powers of two)
MAX_GRAPH_ROWS = 1 << 22   # batch × history above this decodes eagerly (the padded history gather grows with it)
EXTEND_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # token buckets of the extend graphs
EXTEND_MAX_LEN = 128       # longest chunk an extend graph steps through recurrently (longer: the chunked kernels)
# token buckets of the prefill graphs (one sequence's chunk alone in a step: longer chunks run eagerly) and their
# checkpoint buckets (more checkpoints in one chunk: eager)
PREFILL_TOKENS = (256, 512) + tuple(range(1024, 16385, 1024))
PREFILL_CKPTS = (2, 8, 32)
PREFILL_HISTORY = (0,) + tuple(1 << i for i in range(10, 17))  # history buckets (cached tokens before the chunk)


@dataclass
class SeqInput:
    """One sequence's share of a forward: `tokens` at positions [start, start + len) (a list of ints, or an int64
    `array` slice of a prompt: `Sequence.input_ids`)."""
    tokens: "list[int] | array"
    start: int
    state_page: int
    mla_pages: list[int]
    want_logits: bool
    checkpoints: list[tuple[int, int]] = ()  # (offset into tokens, slot): KDA states to store mid-chunk
    src: int = -1  # >= 0: a decode whose token is still on the device, `ModelRunner.last_tokens[src]`


def text_model(model):
    """The `KimiLinearForCausalLM` inside a K3ForConditionalGeneration (or the model itself)."""
    return model.language_model if hasattr(model, "language_model") else model


class _Graph:
    """A forward captured in a CUDA graph over inputs in one int64 device buffer (`buf`, filled from the pinned
    `host` by `fill`); subclasses define `fields` (the buffer's parts), `batch` (the forward's `PackedBatch`,
    built on the device from them), `fill` and `select` (the rows returned). `ALL_ROWS`: logits of every row
    (decode) rather than of `batch.rows`."""
    ALL_ROWS = False
    copies = 0  # pool copy segments the graph can run first (`ExtendGraph`; 0: the runner runs them before it)

    def _capture(self, runner: "ModelRunner", mempool) -> None:
        self.runner, self.graph = runner, None
        runner.pool.flush()  # the eager warm-up below reads the pool (its scratch pages)
        self.host_np = self.host.numpy()  # the pinned buffer as NumPy (same memory): `fill` writes through it
        self.host_f = self.fields(self.host_np)  # its fields as views, built once (≈ 20 µs a step after a forward)
        self.fill([], runner.scratch)
        self.buf.copy_(self.host)
        if runner.device.type != "cuda":  # nothing to capture: `__call__` runs the same work eagerly (CPU tests)
            return
        self.copied = torch.cuda.Event()
        side = torch.cuda.Stream(runner.device)
        side.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, cuBLAS picks its kernels
            self.run()
        torch.cuda.current_stream(runner.device).wait_stream(side)
        self.graph, self.tables = torch.cuda.CUDAGraph(), []
        with static_tables(self.tables, runner.device), torch.cuda.graph(self.graph, pool=mempool):
            self.out = self.run()

    @torch.no_grad()
    def run(self) -> torch.Tensor:
        """The captured work, eagerly: the forward over the device buffer's inputs → fp32 logits. Always without
        autograd: with grad on, the fused inference kernels (Triton KDA decode, router) fall back to their
        differentiable paths, and an eager run would not be the work the graph captured. A row with src >= 0
        takes its token from the runner's `last_tokens[src]` (the previous step's sample) instead of ids."""
        r = self.runner
        f = self.fields(self.buf)
        if self.copies:
            apply_page_ops(r.pool.words, f["copies"])
        r.cache.batch = b = self.batch(f)
        ids = f["ids"] if "src" not in f else torch.where(f["src"] >= 0, r.last_tokens[f["src"].clamp_min(0)], f["ids"])
        try:
            return r.logits(ids, None if self.ALL_ROWS else b.rows)
        finally:
            r.cache.batch = None

    def __call__(self, seqs: list[SeqInput], scratch: tuple[int, int], segs=()) -> torch.Tensor:
        if self.graph is not None:
            self.copied.synchronize()  # the previous step's copy out of the pinned buffer has finished
        table = table_of(segs) if segs else None  # the pool copies this step asked for (`PagePool.take_deferred`)
        try:
            self.fill(seqs, scratch)
            if table:
                self.host_f["copies"][:len(table)] = table
        except BaseException:  # the copies must still run before anything reads the pool: the forward did not
            if table:
                apply_page_ops(self.runner.pool.words, torch.tensor(table).to(self.runner.device))
            raise
        self.buf.copy_(self.host, non_blocking=self.graph is not None)
        if self.graph is None:
            self.out = self.run()
        else:
            self.copied.record()
            self.graph.replay()
        return self.select(seqs)


def _page_rows(table: np.ndarray, seqs: list[SeqInput], pad: int | None) -> None:
    """Rows [0, len(seqs)) of `table` [*, width]: each sequence's MLA page table, padded (or cut) with page `pad`
    (None: the rows already hold the padding)."""
    width = table.shape[1]
    for j, s in enumerate(seqs):
        row = s.mla_pages[:width]
        table[j, :len(row)] = row
        if pad is not None:
            table[j, len(row):] = pad


class DecodeGraph(_Graph):
    """One captured decode forward for `batch` sequences with MLA histories up to `history` tokens.
    Inputs live in one int64 device buffer: ids [B] | src [B] | starts [B] | slots [B] | page table [B, pages]."""
    ALL_ROWS = True

    def __init__(self, runner: "ModelRunner", batch: int, history: int, mempool):
        ps = runner.pool.layout.block_size
        self.batch_size, self.history, self.pages = batch, history, -(-history // ps)
        self.host = torch.empty(4 * batch + batch * self.pages, dtype=torch.long,
                                pin_memory=runner.device.type == "cuda")
        self.buf = torch.empty_like(self.host, device=runner.device)
        self._capture(runner, mempool)

    def fields(self, t: torch.Tensor) -> dict:
        B = self.batch_size
        ids, src, starts, slots = t[:4 * B].reshape(4, B)  # views of a tensor or of its NumPy array (`fill`)
        return dict(ids=ids, src=src, starts=starts, slots=slots, table=t[4 * B:].reshape(B, self.pages))

    def batch(self, f: dict) -> PackedBatch:
        return PackedBatch.for_decode(f["starts"], f["slots"], f["table"], self.history,
                                      self.runner.pool.layout.block_size)

    def fill(self, seqs: list[SeqInput], scratch: tuple[int, int]) -> None:
        """Write the step's inputs into the pinned host buffer; entries past len(seqs) are padding that reads
        and writes only the scratch slot and page."""
        n = len(seqs)
        f = self.host_f  # NumPy: a few µs per step where torch ops on small tensors took ≈ 10 each
        h = self.host_np[:4 * self.batch_size].reshape(4, self.batch_size)
        h[:, n:] = np.array([[0], [-1], [0], [scratch[0]]])
        f["table"][n:] = scratch[1]
        if n:
            h[:, :n] = [[s.tokens[0] for s in seqs], [s.src for s in seqs], [s.start for s in seqs],
                        [s.state_page for s in seqs]]
            _page_rows(f["table"], seqs, scratch[1])

    def select(self, seqs: list[SeqInput]) -> torch.Tensor:
        return self.out[:len(seqs)]


class ExtendGraph(_Graph):
    """One captured forward of up to `tokens` new tokens from up to `seqs` sequences (a few tokens each: short
    prefill chunks, prefix-hit tails, decodes beside them) with MLA histories up to `history` tokens, in the
    decode form (`PackedBatch.for_extend`: KDA and the short conv step each sequence through its tokens in its
    pool slot, MLA reads every token's history from the pages) → the logits of each sequence's last token.
    Inputs: one int64 device buffer ids [N] | src [N] | pos [N] | tdoc [N] | cu [n + 1] | slots [n] |
    page table [n + 1, pages] | int32 pairs: the 16-token runs [R, 2], each sequence's first run [n] and cu
    [n + 1] (`token_runs_host`, R = N // 16 + n + 1: built by `fill`, not by ≈ 50 small kernels in the graph);
    padding tokens belong to no sequence (row n of the table: the scratch page), padding sequences are empty (the
    scratch slot)."""

    def __init__(self, runner: "ModelRunner", tokens: int, seqs: int, history: int, mempool):
        ps = runner.pool.layout.block_size
        self.tokens, self.seqs, self.history, self.pages = tokens, seqs, history, -(-history // ps)
        # `_padding`'s buffer and the scratch pages it was built for; 0, 1, 2, …
        self._pad, self._pad_for, self._arange = None, None, np.arange(max(tokens, seqs))
        N, n = tokens, seqs
        self.runs = N // STATES_AT_MULTIPLE + n + 1
        self.i32 = -(-(2 * self.runs + 2 * n + 1) // 2)  # int64 words holding the int32 tables
        # room for the copies of n admissions (a slot and a page's rows in every MLA layer each) and n more slots
        # (checkpoints, decode snapshots); more run before the graph
        use = GRAPH_COPIES and (runner.device.type != "cuda" or page_ops_triton())
        self.copies = n * (2 + runner.pool.layout.num_mla_layers) if use else 0
        self.host = torch.empty(self.buffer_words(), dtype=torch.long, pin_memory=runner.device.type == "cuda")
        self.buf = torch.empty_like(self.host, device=runner.device)
        self._capture(runner, mempool)

    def buffer_words(self) -> int:
        N, n = self.tokens, self.seqs
        return 4 * N + 2 * n + 1 + (n + 1) * self.pages + table_words(self.copies) + self.i32

    def fields(self, t: torch.Tensor) -> dict:
        N, n, R = self.tokens, self.seqs, self.runs
        ids, src, pos, tdoc = t[:4 * N].reshape(4, N)  # views of a tensor or of its NumPy array (`fill`)
        at = 4 * N + 2 * n + 1 + (n + 1) * self.pages
        c = at + table_words(self.copies)
        i32 = t[c:].view(torch.int32 if isinstance(t, torch.Tensor) else np.int32)
        return dict(ids=ids, src=src, pos=pos, tdoc=tdoc, cu=t[4 * N:4 * N + n + 1],
                    slots=t[4 * N + n + 1:4 * N + 2 * n + 1],
                    table=t[4 * N + 2 * n + 1:at].reshape(n + 1, self.pages), copies=t[at:c],
                    runs=i32[:2 * R].reshape(R, 2), first=i32[2 * R:2 * R + n], cu32=i32[2 * R + n:2 * R + 2 * n + 1])

    def batch(self, f: dict) -> PackedBatch:
        return PackedBatch.for_extend(f["pos"], f["tdoc"], f["cu"], f["slots"], f["table"], self.history,
                                      self.runner.pool.layout.block_size,
                                      runs=(f["runs"], f["first"], f["cu32"]) if HOST_TABLES else None)

    def _padding(self, scratch: tuple[int, int]) -> np.ndarray:
        """The buffer of an empty batch (every token and sequence padding), built once: `fill` starts from a copy."""
        if self._pad_for != scratch:
            pad = np.zeros_like(self.host_np)  # zeros: the int32 tables' spare word too
            f = self.fields(pad)
            f["ids"][:], f["src"][:], f["pos"][:], f["tdoc"][:], f["cu"][:] = 0, -1, 0, self.seqs, 0
            f["slots"][:], f["table"][:] = scratch
            f["cu32"][:] = 0  # every sequence empty: the rows' runs are the padding's
            token_runs_host([0] * (self.seqs + 1), self.tokens, STATES_AT_MULTIPLE, f["runs"], f["first"])
            self._pad, self._pad_for = pad, scratch
        return self._pad

    def fill(self, seqs: list[SeqInput], scratch: tuple[int, int]) -> None:
        """One copy of the padding, then the sequences' entries. Each NumPy operation costs ≈ 10 µs right after a
        forward (cold caches), so few of them: 11 for one sequence (a prefix hit's tail) where there were ≈ 35."""
        self.host_np[:] = self._padding(scratch)
        if not seqs:
            return
        f, ar = self.host_f, self._arange
        lens = [len(s.tokens) for s in seqs]
        ends = list(itertools.accumulate(lens))
        k, m = len(seqs), ends[-1]
        cu = [0, *ends] + [m] * (self.seqs - k)
        f["cu"][:] = cu
        if HOST_TABLES:
            f["cu32"][:] = cu
            token_runs_host(cu, self.tokens, STATES_AT_MULTIPLE, f["runs"], f["first"])
        f["ids"][:m] = np.fromiter(itertools.chain.from_iterable(s.tokens for s in seqs), np.int64, count=m)
        f["tdoc"][:m] = np.repeat(ar[:k], lens)
        # position of token i of sequence j: start_j + i - cu_j
        np.add(ar[:m], np.repeat([s.start + n - e for s, n, e in zip(seqs, lens, ends)], lens), out=f["pos"][:m])
        for s, n, e in zip(seqs, lens, ends):
            if s.src >= 0:  # a decode fed from the device: its token is the previous step's sample
                f["src"][e - n] = s.src
        f["slots"][:k] = [s.state_page for s in seqs]
        _page_rows(f["table"], seqs, None)  # padding rows and columns are the scratch page already

    def select(self, seqs: list[SeqInput]) -> torch.Tensor:
        want = [j for j, s in enumerate(seqs) if s.want_logits]
        return self.out[:len(seqs)] if len(want) == len(seqs) else self.out[want]


class PrefillGraph(_Graph):
    """One captured forward of one sequence's prefill chunk alone in a step (`PackedBatch.for_prefill`): up to
    `tokens` new tokens after up to `history` cached ones (0: a prompt's first chunk) with up to `ckpts` KDA
    checkpoints inside; the chunked kernels as in an eager prefill, every table built on the device; rows past the
    chunk are padding (no state reads them, their latents go to the scratch page) → the logits of its last token.
    Inputs: one int64 device buffer ids [N] | start [1] | length [1] | slot [1] | page table [pages] | checkpoint
    offsets [M] (0: unused) | checkpoint slots [M] (unused: the scratch slot) | int32 pairs: the chunk's 16-token
    runs [R, 2], first run [1], cu [2], chunk → checkpoint table [R + 1] and conv tiles [NT, 2] (R = N // 16 + 2;
    `prefill_tables_host`: built by `fill`, not by ≈ 35 small kernels in the graph)."""

    def __init__(self, runner: "ModelRunner", tokens: int, history: int, ckpts: int, mempool):
        ps = runner.pool.layout.block_size
        self.tokens, self.history, self.ckpts = tokens, history, ckpts
        self.pages = -(-(history + tokens) // ps)
        self.runs, self.tiles = tokens // STATES_AT_MULTIPLE + 2, -(-tokens // CONV_TILE)
        self.i32 = -(-(2 * self.runs + 3 + self.runs + 1 + 2 * self.tiles) // 2)  # int64 words of the int32 tables
        self.host = torch.empty(tokens + 3 + self.pages + 2 * ckpts + self.i32, dtype=torch.long,
                                pin_memory=runner.device.type == "cuda")
        self.buf = torch.empty_like(self.host, device=runner.device)
        self._capture(runner, mempool)

    def fields(self, t: torch.Tensor) -> dict:
        N, P, M, R = self.tokens, self.pages, self.ckpts, self.runs
        at = N + 3 + P + 2 * M
        i32 = t[at:].view(torch.int32 if isinstance(t, torch.Tensor) else np.int32)
        return dict(ids=t[:N], start=t[N:N + 1], length=t[N + 1:N + 2], slot=t[N + 2:N + 3],
                    table=t[N + 3:N + 3 + P], ckpt_pos=t[N + 3 + P:N + 3 + P + M], ckpt_pages=t[N + 3 + P + M:at],
                    runs=i32[:2 * R].reshape(R, 2), first=i32[2 * R:2 * R + 1], cu32=i32[2 * R + 1:2 * R + 3],
                    chunk_slots=i32[2 * R + 3:3 * R + 4],
                    tiles=i32[3 * R + 4:3 * R + 4 + 2 * self.tiles].reshape(self.tiles, 2))

    def batch(self, f: dict) -> PackedBatch:
        lay = self.runner.pool.layout
        return PackedBatch.for_prefill(f["start"], f["length"], f["slot"], f["table"], f["ckpt_pos"], f["ckpt_pages"],
                                       self.tokens, self.history, lay.block_size, lay.conv_width,
                                       self.runner.scratch[1], tables=tuple(
                                           f[k] for k in ("runs", "first", "cu32", "chunk_slots", "tiles"))
                                       if HOST_TABLES else None)

    def fill(self, seqs: list[SeqInput], scratch: tuple[int, int]) -> None:
        f = self.host_f  # NumPy views of the pinned buffer
        s = seqs[0] if seqs else SeqInput(tokens=[], start=0, state_page=scratch[0], mla_pages=[], want_logits=True)
        m, c = len(s.tokens), list(s.checkpoints)
        f["ids"][m:], f["start"][0], f["length"][0], f["slot"][0] = 0, s.start, m, s.state_page
        if m:
            f["ids"][:m] = s.tokens  # an int64 array (a prompt's slice) is copied through the buffer protocol
        _page_rows(f["table"][None], [s], scratch[1])
        f["ckpt_pos"][:], f["ckpt_pages"][:] = 0, scratch[0]
        if c:
            f["ckpt_pos"][:len(c)] = [o for o, _ in c]
            f["ckpt_pages"][:len(c)] = [p for _, p in c]
        if HOST_TABLES:
            prefill_tables_host(m, [o for o, _ in c] + [0] * (self.ckpts - len(c)), self.tokens,
                                *(f[k] for k in ("runs", "first", "cu32", "chunk_slots", "tiles")))

    def select(self, seqs: list[SeqInput]) -> torch.Tensor:
        return self.out[:1] if seqs[0].want_logits else self.out[:0]


class ModelRunner:
    """`max_seqs`: the most sequences one step samples (the size of `last_tokens`)."""

    def __init__(self, model, pool: PagePool, kda_backend: str = "auto", cuda_graphs: bool = True,
                 max_seqs: int = 256):
        self.lm = text_model(model)
        self.cfg = self.lm.config
        self.pool = pool
        layers = self.lm.model.decoder_layers
        self.cache = PagedCache(pool.state, pool.conv, pool.mla,
                                kda_layers=[l.layer_idx for l in layers if l.is_kda],
                                mla_layers=[l.layer_idx for l in layers if not l.is_kda],
                                kda_backend=None if kda_backend == "auto" else kda_backend)
        self.device = self.lm.lm_head.weight.device
        # the latest step's sampled ids on the device (`published`): the next forward's decodes read theirs here
        self.last_tokens = torch.zeros(max(max_seqs, 1), dtype=torch.long, device=self.device)
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}
        self._mempool = None
        self.use_graphs = False  # set below when the scratch pages are reserved; benchmarks turn it off
        self.use_extend_graphs = True  # short chunks too (`ExtendGraph`), when use_graphs
        self.use_prefill_graphs = True  # and one sequence's long chunk alone in a step (`PrefillGraph`)
        self.scratch: tuple[int, int] | None = None  # (KDA slot, MLA page) the graphs' padding entries use
        # capturable only where the MoE takes its sync-free grouped path (bf16 activations on CUDA); fp32 models
        # decode eagerly (the per-expert loop reads expert counts on the host)
        act = torch.empty(0, dtype=self.lm.model.embed_tokens.weight.dtype, device=self.device)
        if cuda_graphs and grouped_mm_available(act):
            self.enable_graphs()

    def enable_graphs(self) -> bool:
        """Reserve the graphs' scratch slot and page and turn the graph paths on (done at construction where the
        graphs can be captured; tests call it on the CPU, where the same paths run eagerly). False: the pool
        has no room for them."""
        if self.scratch is None:
            if self.pool.num_free < 4:
                return False
            try:
                self.scratch = (self.pool.allocate(), self.pool.allocate())
            except PoolExhausted:
                return False
            self.pool.zero_slot(self.scratch[0])
        self.use_graphs = True
        return True

    @property
    def reserved_pages(self) -> list[int]:
        """Pages the runner holds for itself (the graphs' scratch slot and page)."""
        return [] if self.scratch is None else list(self.scratch)

    def batch(self, seqs: list[SeqInput]) -> PackedBatch:
        """The packed forward's metadata (decode sequences, one token each, should come first)."""
        if any(len(s.tokens) == 0 for s in seqs):
            raise ValueError("empty SeqInput: every sequence in a forward needs at least one token")
        return PackedBatch.build([len(s.tokens) for s in seqs], [s.start for s in seqs],
                                 [s.state_page for s in seqs], [s.mla_pages for s in seqs],
                                 [s.want_logits for s in seqs], self.pool.layout.block_size,
                                 self.pool.layout.conv_width, self.device, [list(s.checkpoints) for s in seqs])

    def logits(self, ids: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """fp32 logits [R, V] of a packed forward over ids [N] (`cache.batch` set), at `rows` (None: all). A
        bf16 / fp16 head writes fp32 straight from its GEMM where the device can (no [R, V] cast kernel)."""
        _, hn, _ = self.lm.model(self.lm.model.embed_tokens(ids)[None], cache=self.cache, rows=rows)
        head = self.lm.lm_head
        if hn.dtype != torch.float32 and head.bias is None:
            return gemv.linear(hn[0], head.weight, torch.float32)  # the GEMV kernel for a few rows, else cuBLAS
        return head(hn)[0].float()

    def graph_for(self, seqs: list[SeqInput]) -> _Graph | None:
        """The captured graph for this step (captured on first use), or None when it must run eagerly: a
        `DecodeGraph` for one token per sequence, a `PrefillGraph` for one sequence's chunk alone in the step
        (longer than `EXTEND_MAX_LEN`, up to `PREFILL_TOKENS[-1]` tokens after up to `PREFILL_HISTORY[-1]`), an
        `ExtendGraph` for short chunks (each ≤ `EXTEND_MAX_LEN` tokens, no KDA checkpoint inside, ≤
        `EXTEND_TOKENS[-1]` tokens in all)."""
        if not self.use_graphs:
            return None
        i = bisect.bisect_left(BATCH_BUCKETS, len(seqs))
        if i == len(BATCH_BUCKETS):
            return None
        n = BATCH_BUCKETS[i]
        last = max(s.start + len(s.tokens) - 1 for s in seqs)  # the furthest position written
        S = max(MIN_HISTORY, 1 << last.bit_length())  # > every position
        if all(len(s.tokens) == 1 and s.want_logits for s in seqs):
            rows, key, make = n, (n, S), lambda: DecodeGraph(self, n, S, self._mempool)
        elif len(seqs) == 1 and len(seqs[0].tokens) > EXTEND_MAX_LEN:
            s = seqs[0]
            j = bisect.bisect_left(PREFILL_TOKENS, len(s.tokens))
            k = bisect.bisect_left(PREFILL_CKPTS, len(s.checkpoints))
            h = bisect.bisect_left(PREFILL_HISTORY, s.start)
            if (not self.use_prefill_graphs or s.src >= 0 or j == len(PREFILL_TOKENS) or k == len(PREFILL_CKPTS)
                    or h == len(PREFILL_HISTORY)):
                return None
            N, M, Hb = PREFILL_TOKENS[j], PREFILL_CKPTS[k], PREFILL_HISTORY[h]
            rows, S, key, make = 1, 1, ("prefill", N, Hb, M), lambda: PrefillGraph(self, N, Hb, M, self._mempool)
        else:
            m = sum(len(s.tokens) for s in seqs)
            j = bisect.bisect_left(EXTEND_TOKENS, m)
            if (not self.use_extend_graphs or j == len(EXTEND_TOKENS) or any(s.checkpoints for s in seqs)
                    or max(len(s.tokens) for s in seqs) > EXTEND_MAX_LEN):
                return None
            N = EXTEND_TOKENS[j]
            rows, key, make = N, ("extend", N, n, S), lambda: ExtendGraph(self, N, n, S, self._mempool)
        if rows * S > MAX_GRAPH_ROWS:
            return None
        if key not in self.graphs:
            self.graphs[key] = make()
            if self.graphs[key].graph is not None:
                self._mempool = self.graphs[key].graph.pool()
        return self.graphs[key]

    def warm_up(self, prefill_tokens=(), decode_batches=()) -> list[tuple]:
        """Capture now (a server before it takes requests) the graphs that a prompt's first chunk of each
        `prefill_tokens` length and a decode step of each `decode_batches` size (histories up to `MIN_HISTORY`)
        replay, so that no request pays their capture and kernel compilation. Returns the graph keys present."""
        if not self.use_graphs:
            return []
        bad = [n for n in (*prefill_tokens, *decode_batches) if not isinstance(n, int) or n < 1]
        if bad:
            raise ValueError(f"warm_up: token counts and batch sizes must be positive ints, got {bad[:4]}")
        def probe(n: int) -> SeqInput:  # only its shape matters: graph_for captures, nothing runs on it
            return SeqInput(tokens=[0] * n, start=0, state_page=self.scratch[0], mla_pages=[], want_logits=True)

        for n in prefill_tokens:
            self.graph_for([probe(n)])
        for b in decode_batches:
            self.graph_for([probe(1)] * b)
        return sorted(self.graphs, key=str)

    def published(self, n: int) -> torch.Tensor:
        """Where a step's n sampled ids go for the next forward's `SeqInput.src` rows (`last_tokens`; the sampler
        writes them, a failed row's -1 as 0: the sequence is dropped when the host sees it, and an id must stay a
        valid index)."""
        if n > self.last_tokens.shape[0]:
            raise ValueError(f"{n} sampled ids exceed the runner's max_seqs {self.last_tokens.shape[0]}")
        return self.last_tokens

    @torch.no_grad()
    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Run one packed forward; returns fp32 logits [R, V] for the sequences with `want_logits`, in order."""
        if not seqs:
            raise ValueError("ModelRunner.forward: no sequences")
        g = self.graph_for(seqs)
        self.pool.defer = GRAPH_COPIES and self.use_graphs and self.use_extend_graphs  # for the next step's copies
        segs = self.pool.take_deferred(g.copies) if g is not None and g.copies else []
        if not segs:
            self.pool.flush()  # those not taken run first (none with `defer` off)
        if g is not None:
            return g(seqs, self.scratch, segs)
        b = self.batch(seqs)
        ids = to_device(torch.tensor([t for s in seqs for t in s.tokens]), self.device)
        src, at = [], 0
        for s in seqs:  # packed position of each device-fed token
            if s.src >= 0:
                src.append((at, s.src))
            at += len(s.tokens)
        if src:
            at = to_device(torch.tensor(src), self.device)
            ids[at[:, 0]] = self.last_tokens[at[:, 1]]
        self.cache.batch = b
        try:
            return self.logits(ids, b.rows)
        finally:
            self.cache.batch = None
