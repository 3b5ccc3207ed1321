"""The model's cache over a paged pool (the serving engine's), and the metadata of one packed forward.

The engine runs the model on ONE packed row [1, N] of documents, the training path's `cu_seqlens` packing:
each document is one sequence's new tokens (a decode token or a prefill chunk) continuing that sequence's
cached history at position `start`. A layer reads and writes the history through `PagedLayerCache`:

- KDA: each document's short-conv window (the W-1 projected inputs before its first new token) and fp32
  recurrent state come from its slot (`slots`); the final ones go back there.
- MLA: the new latents `c ‖ k_pe` are written at each token's (page, row); then each document attends its
  whole history [0, start + T) read back from its pages, causal with a position offset of `start`.

`K3Cache` (cache.py) is the contiguous counterpart for `generate` ([B, T] rows with a padding mask, one dict
per layer). The pool's tensors belong to the caller: `PagedCache` only holds views of them
(state [P, n_kda, H, K, V] fp32, conv [P, n_kda, 3, H·K, W-1], mla [P, n_mla, page_size, C + R]), so the
model never imports the engine and the engine never re-implements a layer.
"""

from __future__ import annotations

import itertools

from dataclasses import dataclass, field

import numpy as np
import torch

from ..ops._host import to_device
from ..ops.conv import CONV_TILE, conv_tiles
from ..ops.kda import STATES_AT_MULTIPLE, chunk_slots, extend_in_chunks
from ..ops import mla_decode
from ..ops.mla_decode import GROUP_ROWS, page_of_positions, write_latents


@dataclass
class PackedBatch:
    """Index tensors of one packed forward over n documents and N = Σ lens tokens (see `build`).

    `tok_page`, `tok_off` [N]: where each new token's latent goes. `cu_seqlens` int32
    [n + 1]. `slots` [n]: KDA slot per document. `rows` [R]: packed positions whose logits are wanted.
    Conv: `conv_tiles` int32 [NT, 2] (document, first token) of every `CONV_TILE`-token tile (the short conv runs
    one program per tile, reading each document's window from its slot). MLA: the first `num_decode`
    documents are single tokens read in the absorbed form from `dec_page`, `dec_off`, `dec_valid` [nd, S] and
    `dec_len` [nd] (start + 1: the history each attends, its own row included);
    the others read their history rows `hist_page`, `hist_off` (document after document, bounds `hist_cu`).
    KDA checkpoints inside prefill chunks (the prefix cache's states, without cutting the forward there):
    `ckpt_pos` (host) [M] packed positions among the chunked documents' tokens (`chunk_cu_seqlens`' frame),
    `ckpt_pages` [M] the slots they go to, `ckpt_win_rows` [M, W-1] the packed token rows of their conv windows
    (the W-1 inputs before each; checkpoints lie at least 16 tokens into their document).
    Extend batches (`for_extend`, a captured CUDA graph over a few new tokens per sequence) are decode-shaped
    for MLA (every token is a single-token row of the absorbed form, `num_decode` = N) while KDA steps each
    sequence through its tokens: `step_cu` [n + 1] bounds sequence i's tokens, `slots` [n] its KDA slots;
    `dec_groups` [NG, 2] runs of up to `GROUP_ROWS` tokens of one sequence for the MLA kernel (first, count);
    `step_chunks` (tiles [NC, 2], first tile [n]): the sequences' 16-token tiles for the chunked KDA kernels.
    Graph prefill batches (`for_prefill`, a captured CUDA graph over one sequence's prefill chunk, padded):
    `graph_prefill`; KDA and the conv advance the slot in place as in an extend batch
    (`step_cu`, `step_chunks`, `conv_tiles` built on the device), with the checkpoints' positions `step_states_at`
    [M] on the device (< 1: padding, whose `ckpt_pages` entry is the scratch slot) and their chunk table
    `step_state_slots` (built once here for every layer); MLA attends causally within
    the new tokens (start 0), or with history over the key rows `hist_page`, `hist_off` ([history + tokens]:
    positions from 0, the first `key_len` [1] of them attended).
    """
    lens: list[int]
    starts: list[int]
    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor
    tok_page: torch.Tensor
    tok_off: torch.Tensor
    conv_tiles: torch.Tensor | None
    num_decode: int
    dec_page: torch.Tensor | None
    dec_off: torch.Tensor | None
    dec_valid: torch.Tensor | None
    dec_len: torch.Tensor | None
    hist_page: torch.Tensor | None
    hist_off: torch.Tensor | None
    hist_cu: list[int]
    ckpt_pos: torch.Tensor | None = None
    ckpt_pages: torch.Tensor | None = None
    ckpt_win_rows: torch.Tensor | None = None
    step_cu: torch.Tensor | None = None
    dec_groups: torch.Tensor | None = None
    step_chunks: tuple[torch.Tensor, torch.Tensor] | None = None
    step_states_at: torch.Tensor | None = None
    step_state_slots: torch.Tensor | None = None
    graph_prefill: bool = False
    key_len: torch.Tensor | None = None
    dec_history: int | None = None  # set: `dec_page` is each decode row's page table [nd, P] over this many
    # positions (`mla_decode.PAGE_TABLE`), and `dec_off` / `dec_valid` are not built
    _positions: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def decode_positions(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page, row offset, valid) [nd, S] of the decode rows' histories, per position: the fields themselves,
        or, from page tables (`dec_history`), converted once per batch (not once per MLA layer)."""
        if self.dec_history is None:
            return self.dec_page, self.dec_off, self.dec_valid
        if self._positions is None:
            self._positions = per_position(self.dec_page, self.dec_len, self.dec_history, page_size)
        return self._positions

    @property
    def num_docs(self) -> int:
        return len(self.lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)

    @property
    def chunk_cu_seqlens(self) -> torch.Tensor:
        """int32 [n - nd + 1] ON THE HOST: bounds of the documents after the decodes (whose tokens start at
        packed position num_decode), relative to their first token. On the host because the chunked KDA kernels
        build their tables from it there: a device copy would be read back once per layer (a host sync)."""
        return torch.tensor([0, *itertools.accumulate(self.lens[self.num_decode:])], dtype=torch.int32)

    @property
    def decode(self) -> bool:
        """Every document is a single token: KDA takes the one-step decode, MLA the absorbed form only."""
        return self.num_decode == len(self.lens)

    @classmethod
    def build(cls, lens: list[int], starts: list[int], slots: list[int], page_tables: list[list[int]],
              want_logits: list[bool], page_size: int, conv_width: int, device,
              checkpoints: list[list[tuple[int, int]]] | None = None) -> "PackedBatch":
        """Documents j = 0..n-1 of `lens[j]` new tokens at positions [starts[j], starts[j] + lens[j]) of a
        sequence whose KDA slot is `slots[j]` and whose MLA pages are `page_tables[j]` (page i holds positions
        [i·page_size, (i+1)·page_size)); `conv_width` = kernel size - 1. Leading single-token documents are the
        decodes (the engine puts them first). `checkpoints[j]`: (offset, slot) pairs asking for document j's KDA
        state and conv window after its first `offset` new tokens (0 < offset < lens[j], a multiple of
        `STATES_AT_MULTIPLE`) to be written to `slot`."""
        n = len(lens)
        if not n or not (len(starts) == len(slots) == len(page_tables) == len(want_logits) == n):
            raise ValueError(f"PackedBatch.build: need n >= 1 documents and one start, slot, page table and "
                             f"want_logits flag each; got {n} lens, {len(starts)} starts, {len(slots)} slots, "
                             f"{len(page_tables)} page tables, {len(want_logits)} flags")
        bad = [(j, l, s) for j, (l, s) in enumerate(zip(lens, starts)) if l < 1 or s < 0]
        if bad:
            raise ValueError(f"PackedBatch.build: each document needs >= 1 token and start >= 0, got "
                             f"(doc, len, start) = {bad[:4]}")
        short = [j for j in range(n) if -(-(starts[j] + lens[j]) // page_size) > len(page_tables[j])]
        if short:
            raise ValueError(f"PackedBatch.build: documents {short[:4]} need more pages than their page tables hold")
        Ps, Wm1 = page_size, conv_width
        lens_t = torch.tensor(lens, dtype=torch.long)
        cu = torch.zeros(n + 1, dtype=torch.long)
        cu[1:] = lens_t.cumsum(0)
        N = int(cu[-1])
        doc = torch.repeat_interleave(torch.arange(n), lens_t)  # [N] document of each token
        pos = torch.arange(N) - cu[:-1][doc] + torch.tensor(starts, dtype=torch.long)[doc]  # absolute positions
        width = max(len(t) for t in page_tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in page_tables], dtype=torch.long)  # [n, pages]
        tok_page = table[doc, pos // Ps]
        ends = cu[1:] - 1
        rows = ends[torch.tensor(want_logits, dtype=torch.bool)]
        win = torch.arange(Wm1)
        nd = 0
        while nd < n and lens[nd] == 1:
            nd += 1
        dec_page = dec_off = dec_valid = dec_len = hist_page = hist_off = None
        hist_cu = [0]
        if nd:  # decode: every history row [0, start + 1) of each single-token document, padded to S
            S = max(starts[:nd]) + 1
            p = torch.arange(S)
            dec_valid = p[None, :] <= torch.tensor(starts[:nd])[:, None]
            dec_page = torch.where(dec_valid, table[:nd, p // Ps], 0)
            dec_off = (p % Ps).expand(nd, S)
            dec_len = torch.tensor(starts[:nd]) + 1
        if nd < n:  # the other documents: rows [0, start + len) each, packed
            hl = torch.tensor([starts[j] + lens[j] for j in range(nd, n)])
            hdoc = torch.repeat_interleave(torch.arange(n - nd), hl)
            hcu = torch.zeros(n - nd + 1, dtype=torch.long)
            hcu[1:] = hl.cumsum(0)
            hp = torch.arange(int(hcu[-1])) - hcu[:-1][hdoc]
            hist_page, hist_off, hist_cu = table[nd + hdoc, hp // Ps], hp % Ps, hcu.tolist()

        ckpt_pos = ckpt_pages = ckpt_win = None
        ck = [(j, o, sl) for j, c in enumerate(checkpoints or []) for o, sl in c]
        if ck:
            M = STATES_AT_MULTIPLE
            bad = [(j, o) for j, o, _ in ck if not (j < n and 0 < o < lens[j] and o % M == 0)]
            if bad:
                raise ValueError(f"PackedBatch.build: checkpoint (document, offset) {bad[:4]} must lie inside its "
                                 f"document's new tokens at a multiple of {M}")
            js, offs = torch.tensor([j for j, _, _ in ck]), torch.tensor([o for _, o, _ in ck])
            ckpt_pos = cu[js] - nd + offs  # among the chunked documents' tokens (the decodes come first)
            ckpt_pages = torch.tensor([sl for _, _, sl in ck], dtype=torch.long)
            ckpt_win = cu[js][:, None] + offs[:, None] - Wm1 + win  # the W-1 inputs before token `offset`

        def dev(t):
            return None if t is None else to_device(t, device)

        return cls(lens=list(lens), starts=list(starts), cu_seqlens=dev(cu.to(torch.int32)),
                   slots=dev(torch.tensor(slots, dtype=torch.long)), rows=dev(rows), tok_page=dev(tok_page),
                   tok_off=dev(pos % Ps), conv_tiles=conv_tiles(lens, device), num_decode=nd, dec_page=dev(dec_page),
                   dec_off=dev(dec_off), dec_valid=dev(dec_valid), dec_len=dev(dec_len), hist_page=dev(hist_page),
                   hist_off=dev(hist_off), hist_cu=hist_cu, ckpt_pos=ckpt_pos, ckpt_pages=dev(ckpt_pages),
                   ckpt_win_rows=dev(ckpt_win))


    @classmethod
    def for_decode(cls, starts: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, history: int,
                   page_size: int) -> "PackedBatch":
        """A pure decode batch built ON THE DEVICE from device tensors, for a captured CUDA graph: n sequences
        of one token each at positions `starts` [n] (long), KDA slots `slots` [n], MLA page tables `table`
        [n, pages] (long). `history` (static) bounds every start + 1 (the padded MLA history length S).
        Every field comes from tensor ops on the inputs (no host data), so a graph captured over this batch
        replays correctly after new values are copied into `starts`, `slots` and `table`. The conv tiles and
        prefill-history fields are unused by a decode forward and left empty."""
        ar = torch.arange(starts.shape[0] + 1, device=starts.device)
        return cls._token_rows(starts, table, history, page_size, slots=slots, rows=ar[:-1])

    @classmethod
    def for_extend(cls, pos: torch.Tensor, tdoc: torch.Tensor, cu: torch.Tensor, slots: torch.Tensor,
                   table: torch.Tensor, history: int, page_size: int,
                   runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> "PackedBatch":
        """An extend batch built ON THE DEVICE for a captured CUDA graph: N tokens at positions `pos` [N] of
        the sequences `tdoc` [N] (row of `table` [n + 1, pages], long, whose last row may be padding's), n
        sequences with tokens cu[i]..cu[i+1] (`cu` [n + 1], long) and KDA slots `slots` [n]. Tokens past cu[n]
        are padding: no KDA / conv state reads them, and their MLA rows read and write `table[tdoc]`'s pages
        only. Logits rows: each sequence's last token (cu[1:] - 1; an empty sequence's row is unused).
        `history` (static) bounds every pos + 1. `runs` (optional): the int32 tables `token_runs(cu, N, 16,
        first=True)` and `cu` would give, already built (by `token_runs_host`, in the graph's input buffer):
        (runs [N // 16 + n + 1, 2], first run [n], cu [n + 1]); otherwise they are built here (≈ 25 small kernels,
        one `token_runs` for both the MLA groups and the KDA tiles)."""
        N, n = pos.shape[0], cu.shape[0] - 1
        chunked = extend_in_chunks(N, n)
        if runs is None:
            t = token_runs(cu, N, STATES_AT_MULTIPLE, first=True)
            groups = t[0] if GROUP_ROWS == STATES_AT_MULTIPLE else token_runs(cu, N, GROUP_ROWS)
            chunks, step_cu = _int32(t) if chunked else None, cu.to(torch.int32)
        else:
            if GROUP_ROWS != STATES_AT_MULTIPLE:
                raise ValueError(f"PackedBatch.for_extend: prebuilt runs serve the MLA groups ({GROUP_ROWS} rows) "
                                 f"and the KDA tiles ({STATES_AT_MULTIPLE}) only when both are equal")
            groups, chunks, step_cu = runs[0], runs[:2] if chunked else None, runs[2]
        return cls._token_rows(pos, table[tdoc], history, page_size, slots=slots, rows=cu[1:] - 1,
                               step_cu=step_cu, dec_groups=groups, step_chunks=chunks)

    @classmethod
    def for_prefill(cls, start: torch.Tensor, length: torch.Tensor, slot: torch.Tensor, table: torch.Tensor,
                    ckpt_pos: torch.Tensor, ckpt_pages: torch.Tensor, tokens: int, history: int, page_size: int,
                    conv_width: int, scratch_page: int, tables: tuple[torch.Tensor, ...] | None = None
                    ) -> "PackedBatch":
        """One sequence's prefill chunk built ON THE DEVICE for a captured CUDA graph: `length` new tokens ([1] long,
        ≤ `tokens`, the static padded row count) at positions start .. start + length - 1 (`start` [1] long ≤
        `history`, the static history bucket; 0: a cold chunk, start = 0), KDA slot `slot` [1], MLA page table
        `table` [ceil((history + tokens) / page_size)] (long). Rows past `length` are padding: no KDA / conv state
        reads them, their latents go to `scratch_page`. `ckpt_pos` [M]: offsets of KDA checkpoints into the chunk
        (multiples of `STATES_AT_MULTIPLE`, 0 < offset < length; 0: unused) whose state and conv window go to
        `ckpt_pages` [M] (an unused one's to a scratch slot). Logits row: length - 1.
        With history, MLA's keys are `history + tokens` rows read from the pages (`hist_page`, `hist_off`):
        positions 0 .. start + tokens - 1 (past start + length: the scratch page), then unused rows; `key_len`
        [1] = start + tokens, so that causal attention aligned to the last key is each query's history and chunk
        prefix (a padding row's too, over scratch rows).
        `tables` (optional): the int32 tables below already built (`prefill_tables_host`, in the graph's input
        buffer): (16-token runs [tokens // 16 + 2, 2], first run [1], cu [2], chunk → checkpoint [tokens // 16 + 3],
        conv tiles [ceil(tokens / CONV_TILE), 2]); otherwise they are built here (≈ 35 small kernels)."""
        dev = length.device
        i = torch.arange(tokens, device=dev)
        pos = start + i
        if tables is None:
            cu = torch.cat([length.new_zeros(1), length])
            chunks = _int32(token_runs(cu, tokens, STATES_AT_MULTIPLE, first=True))
            cu = cu.to(torch.int32)  # the kernels' bounds (one conversion for every use below)
            slots = chunk_slots(ckpt_pos, cu, chunks[1], chunks[0].shape[0])
            tiles = torch.stack([torch.zeros_like(i[::CONV_TILE]), i[::CONV_TILE]], 1).to(torch.int32)
        else:
            runs, first, cu, slots, tiles = tables
            chunks = (runs, first)
        win = ckpt_pos[:, None] - conv_width + torch.arange(conv_width, device=dev)
        hist_page = hist_off = key_len = None
        if history:
            p = torch.arange(history + tokens, device=dev)  # the position of each key row
            hist_page = torch.where(p < start + length, table[p // page_size], scratch_page)
            hist_off, key_len = p % page_size, start + tokens
        return cls(lens=[tokens], starts=[0], cu_seqlens=cu, slots=slot, rows=length - 1,
                   tok_page=torch.where(i < length, table[pos // page_size], scratch_page), tok_off=pos % page_size,
                   conv_tiles=tiles, num_decode=0, dec_page=None, dec_off=None, dec_valid=None, dec_len=None,
                   hist_page=hist_page, hist_off=hist_off, hist_cu=[0], ckpt_pages=ckpt_pages,
                   ckpt_win_rows=win.clamp_min(0), step_cu=cu, step_chunks=chunks, step_states_at=ckpt_pos,
                   step_state_slots=slots, graph_prefill=True,
                   key_len=key_len)

    @classmethod
    def _token_rows(cls, pos, table, history, page_size, slots, rows, step_cu=None, dec_groups=None,
                    step_chunks=None) -> "PackedBatch":
        """Every token a single-token row for MLA (its page table row `table` [N, pages], history [0, pos])."""
        n, dev = pos.shape[0], pos.device
        if mla_decode.PAGE_TABLE:  # the MLA kernel reads each row's page table itself
            dec_page, dec_off, valid, dec_history = table, None, None, history
        else:
            (dec_page, dec_off, valid), dec_history = per_position(table, pos + 1, history, page_size), None
        return cls(lens=[1] * n, starts=[0] * n, cu_seqlens=torch.arange(n + 1, device=dev, dtype=torch.int32),
                   slots=slots, rows=rows, tok_page=table.gather(1, (pos // page_size)[:, None])[:, 0],
                   tok_off=pos % page_size, conv_tiles=None,
                   num_decode=n, dec_page=dec_page, dec_off=dec_off, dec_valid=valid,
                   dec_len=pos + 1, hist_page=None, hist_off=None, hist_cu=[0], step_cu=step_cu,
                   dec_groups=dec_groups, step_chunks=step_chunks, dec_history=dec_history)


def per_position(table: torch.Tensor, lens: torch.Tensor, history: int, page_size: int):
    """The per-position form of single-token rows' page tables `table` [n, P] with histories `lens` [n] over a
    padded history of `history` positions: (page [n, S] (0 past each length), row offset [n, S], valid [n, S])."""
    p = torch.arange(history, device=table.device)
    valid = p[None, :] < lens[:, None]
    page = torch.where(valid, page_of_positions(table, history, page_size), 0)
    return page, (p % page_size).expand(table.shape[0], history), valid


def _int32(tables):
    """The kernels' index tables in int32: 64-bit bounds make the latency-bound recurrence loop do its address
    arithmetic in 64 bits (H200, one 8K prefill: 8.6 ms of recurrence against 7.6 with int32 tables)."""
    return tuple(t.to(torch.int32) for t in tables)


def token_runs(cu: torch.Tensor, N: int, G: int, first: bool = False):
    """Runs of up to G consecutive rows of one sequence, ON THE DEVICE with a static count: sequences cu[i] ..
    cu[i+1] (long [n + 1]) and the rows cu[n] .. N after them as one more, each cut into ceil(len / G) runs.
    Returns long [N // G + n + 1, 2] of (first row, count); unused entries are (0, 0). With `first`, also the
    index of each sequence's first run, long [n] (the chunked KDA kernels' tile table and offsets)."""
    n = cu.shape[0] - 1
    bounds = torch.cat([cu, cu.new_full((1,), N)])  # [n + 2]
    per = (bounds[1:] - bounds[:-1] + G - 1) // G  # runs of each sequence [n + 1]
    ends = torch.cumsum(per, 0)
    j = torch.arange(N // G + n + 1, device=cu.device)
    seq = torch.searchsorted(ends, j, right=True)  # the sequence of run j (n + 1: unused)
    used = seq <= n
    s = seq.clamp_max(n)
    start = bounds[s] + (j - (ends[s] - per[s])) * G
    count = (bounds[s + 1] - start).clamp(0, G)
    runs = torch.stack([torch.where(used, start, 0), torch.where(used, count, 0)], 1)
    return (runs, (ends - per)[:n]) if first else runs


def token_runs_host(cu, N: int, G: int, runs, first) -> None:
    """`token_runs(cu, N, G, first=True)` on the host, written into `runs` [N // G + n + 1, 2] and `first` [n]
    (NumPy arrays, any integer dtype; `cu`: n + 1 ascending ints): for a graph's input buffer, so that the
    captured forward does not build them with ≈ 25 small kernels. Entries past the used ones become (0, 0).
    Host cost: a few µs for a prefix hit's tail, ≈ 10 µs for an 8K prefill chunk (NumPy for long sequences)."""
    n = len(cu) - 1
    bounds = [*cu, N]
    r = 0
    for j in range(n + 1):  # the sequences, then the rows after them as one more
        if j < n:
            first[j] = r
        a, b = bounds[j], bounds[j + 1]
        k = -(-(b - a) // G)
        if r + k > runs.shape[0]:
            raise ValueError(f"token_runs_host: {r + k} runs exceed the table's {runs.shape[0]} rows")
        if 0 < k <= 8:
            runs[r:r + k] = [(x, min(G, b - x)) for x in range(a, b, G)]
        elif k:
            runs[r:r + k, 0] = np.arange(a, b, G)
            runs[r:r + k - 1, 1] = G
            runs[r + k - 1, 1] = b - (a + (k - 1) * G)
        r += k
    runs[r:] = 0


def prefill_tables_host(length: int, ckpts: list[int], tokens: int, runs, first, cu, slots, tiles) -> None:
    """`PackedBatch.for_prefill`'s int32 tables of one chunk of `length` real tokens (of `tokens` rows) with KDA
    checkpoints at offsets `ckpts` (0: unused), built on the host into NumPy arrays (a prefill graph's input
    buffer): the chunk's 16-token runs and first run (`token_runs_host`), cu = (0, length), the chunk → checkpoint
    table of `states_at.chunk_slots` (-1: none; the spare last entry takes the unused checkpoints) and the conv
    tiles (0, t) for t = 0, CONV_TILE, …"""
    token_runs_host([0, length], tokens, STATES_AT_MULTIPLE, runs, first)
    cu[:] = (0, length)
    nc = runs.shape[0]
    slots[:] = -1
    for m, p in enumerate(ckpts):
        slots[(p - 1) // STATES_AT_MULTIPLE if p > 0 else nc] = m
    tiles[:, 0], tiles[:, 1] = 0, np.arange(0, tokens, CONV_TILE)


class PagedCache:
    """The model's view of a paged pool for one packed forward: `layer(i)` gives layer i's `PagedLayerCache`.

    state [P, n_kda, H, K, V] (fp32), conv [P, n_kda, 3, H·K, W-1], mla [P, n_mla, page_size, C + R]: the pool's
    typed views, updated in place. `kda_layers` / `mla_layers`: the decoder-layer indices in pool order.
    `kda_backend`: overrides the KDA modules' `backend` when not None ("torch" / "reference" also select the
    PyTorch decode step). Set `batch` (a `PackedBatch`) before each forward."""

    def __init__(self, state: torch.Tensor, conv: torch.Tensor, mla: torch.Tensor, kda_layers: list[int],
                 mla_layers: list[int], kda_backend: str | None = None):
        if state.dim() != 5 or conv.dim() != 5 or mla.dim() != 4:
            raise ValueError(f"PagedCache: expected state [P, n_kda, H, K, V], conv [P, n_kda, 3, C, W-1] and "
                             f"mla [P, n_mla, page_size, C + R], got {tuple(state.shape)}, {tuple(conv.shape)}, "
                             f"{tuple(mla.shape)}")
        if state.shape[1] != len(kda_layers) or conv.shape[1] != len(kda_layers) or mla.shape[1] != len(mla_layers):
            raise ValueError(f"PagedCache: pool holds {state.shape[1]} KDA / {mla.shape[1]} MLA layers, the model "
                             f"has {len(kda_layers)} / {len(mla_layers)}")
        self.state, self.conv, self.mla = state, conv, mla
        self.index = {i: j for j, i in enumerate(kda_layers)} | {i: j for j, i in enumerate(mla_layers)}
        self.kda_backend = kda_backend
        self.batch: PackedBatch | None = None

    @property
    def page_size(self) -> int:
        return self.mla.shape[2]

    @property
    def conv_width(self) -> int:
        return self.conv.shape[-1]

    def layer(self, idx: int) -> "PagedLayerCache":
        if self.batch is None:
            raise RuntimeError("PagedCache.batch is not set: build a PackedBatch for this forward first")
        if idx not in self.index:
            raise KeyError(f"layer {idx} has no pool slot (pool layers: {sorted(self.index)})")
        return PagedLayerCache(self, self.index[idx])


class PagedLayerCache:
    """One layer's part of a `PagedCache`: what a KDA or MLA module reads and writes in a packed forward."""

    def __init__(self, pc: PagedCache, j: int):
        self.pc, self.j, self.batch = pc, j, pc.batch

    # ---- KDA -------------------------------------------------------------------------------------------
    def conv_pool(self) -> torch.Tensor:
        """[P, 3·H·K, W-1]: this layer's conv windows of every slot (a view of the pool, updated in place)."""
        c = self.pc.conv[:, self.j]
        return c.view(c.shape[0], -1, c.shape[-1])

    def state_pool(self) -> torch.Tensor:
        """[P, H, K, V] fp32: this layer's recurrent state of every slot (a strided view of the pool)."""
        return self.pc.state[:, self.j]

    def states(self) -> torch.Tensor:
        """[n, H, K, V] fp32 (contiguous copy): each document's recurrent state before its first new token."""
        return self.pc.state[:, self.j].index_select(0, self.batch.slots)

    def set_states(self, s: torch.Tensor) -> None:
        self.pc.state[:, self.j][self.batch.slots] = s.to(self.pc.state.dtype)

    def write_checkpoints(self, windows: torch.Tensor, states: torch.Tensor) -> None:
        """windows [M, 3·H·K, W-1], states [M, H, K, V] → the slots `batch.ckpt_pages` (mid-chunk checkpoints)."""
        pages, conv = self.batch.ckpt_pages, self.pc.conv[:, self.j]
        conv[pages] = windows.reshape(-1, *conv.shape[1:]).to(conv.dtype)
        self.pc.state[:, self.j][pages] = states.to(self.pc.state.dtype)

    # ---- MLA -------------------------------------------------------------------------------------------
    def write_latents(self, c: torch.Tensor, k_pe: torch.Tensor, norm: tuple | None = None) -> None:
        """c [N, C], k_pe [N, R] of the new tokens → their (page, row); norm = (weight, eps): c is the raw
        projection, RMS-normalised on the way (`k3.ops.mla_decode.write_latents`: one kernel with it on CUDA)."""
        b = self.batch  # without the norm: the plain ops (the kernel is measured only with it, K3_MLA_FUSED_WRITE)
        write_latents(self.pc.mla[:, self.j], b.tok_page, b.tok_off, c, k_pe, norm,
                      backend="auto" if norm is not None else "reference")

    def mla_pool(self) -> torch.Tensor:
        """[P, page_size, C + R]: this layer's latent rows of every page (a strided view of the pool)."""
        return self.pc.mla[:, self.j]

    def decode_latents(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The leading single-token documents' histories [0, start + 1) (after `write_latents`), padded:
        (c ‖ k_pe [nd, S, C + R] in `dtype`, valid [nd, S] bool); rows past a document's end are zero."""
        page, off, valid = self.batch.decode_positions(self.pc.page_size)
        kv = self.pc.mla[:, self.j][page, off].to(dtype)
        return torch.where(valid[..., None], kv, torch.zeros((), dtype=dtype, device=kv.device)), valid

    def history(self, dtype: torch.dtype) -> torch.Tensor:
        """The other documents' histories [0, start + len) (after `write_latents`), packed document after
        document (bounds `batch.hist_cu`): c ‖ k_pe [M, C + R] in `dtype`."""
        b = self.batch
        return self.pc.mla[:, self.j][b.hist_page, b.hist_off].to(dtype)
