"""Unified paged pool: one device buffer of fixed-size pages, one free list, reference counts.

A page is used either as an **MLA page** (the compressed latent `c` and the shared key slice `k_pe` of
`block_size` consecutive tokens, for every MLA layer) or as a **KDA slot** (the fp32 recurrent state and the
three short-conv windows of one sequence position, for every KDA layer). Both kinds come from the same free
list, so memory moves freely between long contexts (many MLA pages) and many sequences / checkpoints (many KDA
slots). The page size in bytes is the larger of the two, padded (as vLLM pads Mamba pages).

The pool knows nothing about requests or caching: owners take references (`incref`) and drop them
(`decref`); a page returns to the free list when its count reaches zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 256  # bytes; every typed view starts on an aligned offset


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class PoolLayout:
    """Sizes of one page, derived from the model config (see `PoolLayout.for_model`)."""
    block_size: int          # tokens per MLA page
    num_mla_layers: int
    mla_width: int           # kv_lora_rank + qk_rope_head_dim
    num_kda_layers: int
    kda_heads: int
    kda_head_dim: int        # K = V
    conv_channels: int       # H·K
    conv_width: int          # short_conv_kernel_size - 1 (window kept per sequence)
    dtype: torch.dtype       # MLA latents and conv windows; KDA states are always fp32

    @classmethod
    def for_model(cls, text_config, block_size: int, dtype: torch.dtype) -> "PoolLayout":
        cfg = text_config
        n_kda = sum(cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
        la = cfg.linear_attn_config
        return cls(block_size=block_size, num_mla_layers=cfg.num_hidden_layers - n_kda,
                   mla_width=cfg.kv_lora_rank + cfg.qk_rope_head_dim, num_kda_layers=n_kda,
                   kda_heads=la.num_heads, kda_head_dim=la.head_dim, conv_channels=la.num_heads * la.head_dim,
                   conv_width=la.short_conv_kernel_size - 1, dtype=dtype)

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def mla_bytes(self) -> int:
        return self.num_mla_layers * self.block_size * self.mla_width * self.elem

    @property
    def state_bytes(self) -> int:
        return self.num_kda_layers * self.kda_heads * self.kda_head_dim * self.kda_head_dim * 4

    @property
    def conv_bytes(self) -> int:
        return self.num_kda_layers * 3 * self.conv_channels * self.conv_width * self.elem

    @property
    def slot_bytes(self) -> int:
        return _round_up(self.state_bytes, _ALIGN) + self.conv_bytes

    @property
    def page_bytes(self) -> int:
        return _round_up(max(self.mla_bytes, self.slot_bytes, 1), _ALIGN)


class PoolExhausted(RuntimeError):
    """No free page (after whatever eviction the caller tried)."""


class PagePool:
    """`num_pages` pages on `device` with typed views:

    - `mla`   [P, n_mla, block_size, mla_width]   (dtype)   — latent `c` then `k_pe` per token
    - `state` [P, n_kda, H, K, V]                 (fp32)
    - `conv`  [P, n_kda, 3, H·K, W-1]             (dtype)   — q, k, v short-conv windows
    """

    def __init__(self, layout: PoolLayout, num_pages: int, device: torch.device | str = "cpu"):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (one KDA slot and one MLA page per sequence), got {num_pages}")
        self.layout, self.num_pages, self.device = layout, num_pages, torch.device(device)
        L, P, pb = layout, num_pages, layout.page_bytes
        self.storage = torch.empty(P, pb, dtype=torch.uint8, device=self.device)
        self.mla = self.storage[:, :L.mla_bytes].view(L.dtype).view(P, L.num_mla_layers, L.block_size, L.mla_width)
        H, K = L.kda_heads, L.kda_head_dim
        self.state = self.storage[:, :L.state_bytes].view(torch.float32).view(P, L.num_kda_layers, H, K, K)
        off = _round_up(L.state_bytes, _ALIGN)
        self.conv = (self.storage[:, off:off + L.conv_bytes].view(L.dtype)
                     .view(P, L.num_kda_layers, 3, L.conv_channels, L.conv_width))
        self.slot_bytes = L.slot_bytes  # `copy_slot` on every admission: the layout computes it (a torch call)
        # the pool as int64 words (`take_deferred`'s segments index it); page and slot sizes in words
        self.words = self.storage.view(torch.int64).view(-1)
        self.page_words, self.slot_words = pb // 8, -(-L.slot_bytes // 8)
        row = L.mla_width * L.elem  # bytes of one token's latent row
        self._row_words = row // 8 if row % 8 == 0 else None  # None: `copy_tokens` cannot be a word segment
        self.defer = False  # set by the runner: the device copies below wait for the next forward (`take_deferred`)
        self._deferred: list[tuple[str, int, int, int]] = []  # (kind, src, dst, n) in the order they were asked
        self.refcount = [0] * P
        self._free = list(range(P - 1, -1, -1))  # pop() hands out low ids first

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self) -> int:
        """A free page with reference count 1. Raises PoolExhausted when none is free."""
        if not self._free:
            raise PoolExhausted(f"all {self.num_pages} pages are in use")
        p = self._free.pop()
        self.refcount[p] = 1
        return p

    def incref(self, page: int) -> None:
        if self.refcount[page] <= 0:
            raise RuntimeError(f"incref of free page {page}")
        self.refcount[page] += 1

    def decref(self, page: int) -> bool:
        """Drop one reference; returns True when the page went back to the free list."""
        if self.refcount[page] <= 0:
            raise RuntimeError(f"decref of free page {page}")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)
            return True
        return False

    def check(self) -> None:
        """Consistency: free list = exactly the pages with count 0, no duplicates."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("duplicate page in the free list")
        zero = {p for p, c in enumerate(self.refcount) if c == 0}
        if zero != free or any(c < 0 for c in self.refcount):
            raise AssertionError(f"free list {sorted(free)[:8]}… != pages with count 0 {sorted(zero)[:8]}…")

    # ---- device copies (run before the forward that reads them) ---------------------------------
    # With `defer` on, copy_slot / copy_tokens / zero_slot only record what to do: the next forward takes the list
    # (`take_deferred`: an extend graph runs it as its first kernel, with no host call per copy: a 16K prefix hit's
    # two admission copies cost ≈ 0.1 ms of host time on the H200 host) or runs it first (`flush`). Every other
    # access to the pool's memory (the host tier, a pause, the prefix cache's host blocks) flushes first, so the
    # recorded copies always run before anything that reads or overwrites their pages, in the order asked.
    def copy_page(self, src: int, dst: int) -> None:
        """Whole-page copy (a KDA slot: state + conv windows)."""
        self.flush()
        self.storage[dst].copy_(self.storage[src])

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy only the KDA slot bytes of a page (cheaper than a whole page when MLA pages are larger)."""
        self._do("slot", src, dst, 0)

    def copy_tokens(self, src: int, dst: int, n: int) -> None:
        """Copy the first n token rows of an MLA page into another page (every MLA layer)."""
        self._do("tokens", src, dst, n)

    def zero_slot(self, page: int) -> None:
        """Fresh KDA slot: zero state and zero conv windows (= sequence start)."""
        self._do("zero", -1, page, 0)

    def _do(self, kind: str, src: int, dst: int, n: int) -> None:
        if self.defer and (kind != "tokens" or self._row_words is not None):
            self._deferred.append((kind, src, dst, n))
            return
        self.flush()
        self._run(kind, src, dst, n)

    def _run(self, kind: str, src: int, dst: int, n: int) -> None:
        if kind == "slot":
            self.storage[dst, :self.slot_bytes].copy_(self.storage[src, :self.slot_bytes])
        elif kind == "tokens":
            self.mla[dst, :, :n].copy_(self.mla[src, :, :n])
        else:
            self.state[dst].zero_()
            self.conv[dst].zero_()

    def flush(self) -> None:
        """Run the recorded copies now, in order (PyTorch copies, as without `defer`)."""
        ops, self._deferred = self._deferred, []
        for op in ops:
            self._run(*op)

    def take_deferred(self, max_segments: int) -> list[tuple[int, int, int]]:
        """The recorded copies as word segments (src, dst, n) of `words` (src -1: zero-fill), for the caller to run
        at once, all in parallel (`k3.ops.page_ops`), before the forward reads the pool; the list is emptied. []
        when there are none, or (after running them here, `flush`) when they do not fit `max_segments` or depend
        on one another: a page written twice, or read after another copy writes it."""
        ops = self._deferred
        if not ops:
            return []
        dsts = [d for _, _, d, _ in ops]
        if len(set(dsts)) < len(dsts) or any(s in dsts for _, s, _, _ in ops if s >= 0):
            self.flush()
            return []
        pw, L = self.page_words, self.layout
        segs = []
        for kind, src, dst, n in ops:
            if kind == "tokens":  # each MLA layer's first n rows: contiguous within the page
                lw, nw = L.block_size * self._row_words, n * self._row_words
                segs += [(src * pw + i * lw, dst * pw + i * lw, nw) for i in range(L.num_mla_layers)]
            else:
                segs.append((src * pw if src >= 0 else -1, dst * pw, self.slot_words))
        if len(segs) > max_segments:
            self.flush()
            return []
        self._deferred = []
        return segs

    # ---- host tier ---------------------------------------------------------------------------
    def to_host(self, page: int, nbytes: int | None = None) -> torch.Tensor:
        """A CPU copy of a page's first `nbytes` bytes (pinned when the pool is on CUDA)."""
        self.flush()
        n = self.layout.page_bytes if nbytes is None else nbytes
        buf = torch.empty(n, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        buf.copy_(self.storage[page, :n])
        return buf

    def from_host(self, buf: torch.Tensor, page: int) -> None:
        self.flush()
        self.storage[page, :buf.numel()].copy_(buf, non_blocking=False)
