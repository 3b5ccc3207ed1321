"""KDA-aware prefix cache (K3_SPEC §9): chained hashes over fine blocks inside coarse MLA pages, KDA state
checkpoints only at sparse fine-block endpoints, LRU eviction, optional host-memory tier.

Keys. A prompt is cut into fine hash blocks of `hash_block_size` tokens (default 512); block j's key is
H_j = hash(H_{j-1}, tokens of block j), so a key names a whole prefix. An MLA page holds one coarse block of
`block_size` tokens (default 6144 = 12 fine blocks); the page that held the tokens when fine block j was
completed is registered under H_j with `(j mod m + 1)·hash_block_size` valid token rows.

Checkpoints. A KDA slot (state + conv windows after exactly `(j+1)·hash_block_size` tokens) may be
registered under H_j. The engine stores them only at sparse endpoints: the end of each prompt, the
junction where a prompt leaves an already cached prefix, and the last fine boundary a finished / aborted /
preempted sequence passed (plus, optionally, every `checkpoint_interval` blocks).

A hit (`lookup`) is the largest L = j·hash_block_size ≤ len(tokens) − 1 such that H_0 … H_{j-1} are all
cached MLA blocks and a checkpoint exists under H_{j-1}. The engine then shares the full coarse pages
below L (reference counted, read-only), copies the first L mod block_size rows of the partial page and the
checkpoint into fresh pages on the device before the forward (rule 2), and prefills from L.

Rules (the report's): (1) a hit pins its pages in every group before anything is allocated, so the
allocation that follows can never evict them; (2) copies run on the device before the forward, and a
sequence only ever reads rows it (or the hit) wrote; (3) evicting an MLA page drops the checkpoints
registered under that page's keys in the same operation, so a checkpoint is never hit without its MLA
rows — with the host tier, they move to host memory together instead.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .pool import PagePool

ROOT = b"k3-prefix-root"


def chain_hash(parent: bytes, tokens) -> bytes:
    """H_j = the first 16 bytes of SHA-256(H_{j-1} ‖ int64 token ids); `tokens`: a list of ids or their int64 bytes
    (any buffer). SHA-256 runs on the CPUs' SHA instructions: 2.9 µs per 512-token block against 4.9 for
    blake2b-128 (`benchmarks/host_hit.py`: a 16K prompt hashes 32 blocks at admission)."""
    data = tokens if isinstance(tokens, (bytes, memoryview, array)) else array("q", tokens)
    h = hashlib.sha256(parent)
    h.update(data)
    return h.digest()[:16]


def extend_hashes(hashes: list[bytes], tokens, block: int) -> None:
    """Append the keys of every full fine block of `tokens` not yet in `hashes` (in place). `tokens`: a list of
    ids, or a `Sequence`, whose `token_bytes` serves its prompt from the int64 buffer `Engine.submit` checked
    (converting 16K Python ints per lookup cost more than the hashing)."""
    get = getattr(tokens, "token_bytes", None)
    n = tokens.num_tokens if get is not None else len(tokens)
    for j in range(len(hashes), n // block):
        a, b = j * block, (j + 1) * block
        hashes.append(chain_hash(hashes[-1] if hashes else ROOT, get(a, b) if get is not None else tokens[a:b]))


class RecentPrompts:
    """The fine keys of the prompts hashed last (`size` of them, LRU), by the tokens of their first block. A prompt
    that starts like a recent one takes the keys of the leading blocks the two share, found by comparing their
    int64 bytes (exact: equal tokens, equal keys; `bytes.startswith` is a memcmp), and hashes only the rest: a
    16K-token prefix hit compares 128 KB (a few µs) instead of hashing 32 blocks (≈ 120 µs right after a forward).
    Holds a copy of each prompt's full blocks: at most `size` prompts and `max_bytes` of tokens (8 per token; the
    oldest go first), so a few 1M-token prompts do not pin hundreds of MB of host memory."""

    def __init__(self, block: int, size: int = 32, max_bytes: int = 64 << 20):
        self.h, self.size, self.max_bytes = block, size, max_bytes
        self.keys: OrderedDict[bytes, tuple[bytes, list[bytes]]] = OrderedDict()  # block 0 -> (full blocks, keys)
        self.bytes = 0  # sum of the held prompts' full-block bytes

    def extend(self, hashes: list[bytes], seq) -> None:
        """`extend_hashes(hashes, seq, block)` for a `Sequence`; its first call reuses a recent prompt's keys."""
        h, ids = self.h, seq.prompt_ids
        n = len(ids) // h  # full blocks inside the prompt
        if hashes or not n:
            return extend_hashes(hashes, seq, h)
        w = 8 * h  # bytes per block
        cur = memoryview(ids).cast("B")[:n * w]
        first = cur[:w].tobytes()
        prev = self.keys.pop(first, None)
        same = 0
        if prev is not None:  # the most leading blocks both have (block 0 at least: the key)
            self.bytes -= len(prev[0])
            lo, hi = 1, min(n, len(prev[1]))
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if prev[0].startswith(cur[:mid * w]) else (lo, mid - 1)
            same = lo
            hashes += prev[1][:same]
        extend_hashes(hashes, seq, h)
        # keep the recent prompt if it has every block of this one, else this one replaces it
        kept = prev if same == n else (cur.tobytes(), hashes[:n])
        if len(kept[0]) <= self.max_bytes:
            self.keys[first] = kept
            self.bytes += len(kept[0])
        while len(self.keys) > self.size or self.bytes > self.max_bytes:
            self.bytes -= len(self.keys.popitem(last=False)[1][0])

    def clear(self) -> None:
        self.keys.clear()
        self.bytes = 0


@dataclass
class Hit:
    num_tokens: int = 0                 # L: prompt tokens served from the cache
    full_pages: list[int] = field(default_factory=list)  # shared coarse pages [0, L // block_size)
    partial: tuple[int, int] | None = None  # (page, rows) to copy for the block containing L
    checkpoint: int | None = None       # KDA slot page at L
    mla_run: int = 0                    # tokens covered by consecutive cached MLA keys (≥ L)
    host_keys: list[bytes] = field(default_factory=list)  # keys to fetch back from host memory first


class PrefixCache:
    def __init__(self, pool: PagePool, hash_block_size: int, block_size: int, host_bytes: int = 0):
        if hash_block_size < 1 or block_size % hash_block_size:
            raise ValueError(f"hash_block_size ({hash_block_size}) must be >= 1 and divide block_size "
                             f"({block_size})")
        self.pool, self.h, self.B = pool, hash_block_size, block_size
        self.mla: dict[bytes, tuple[int, int]] = {}   # key -> (page, rows)
        self.ckpt: dict[bytes, int] = {}              # key -> KDA slot page
        self.page_keys: dict[int, list[bytes]] = {}   # MLA page -> its keys
        self.ckpt_key: dict[int, bytes] = {}          # checkpoint page -> key
        self.lru: OrderedDict[int, None] = OrderedDict()  # pages the cache holds a reference to
        self.host = HostTier(pool, host_bytes) if host_bytes > 0 else None
        self.recent = RecentPrompts(hash_block_size)
        self.evictions = 0

    # ---- queries -----------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], num_tokens: int) -> Hit:
        """Deepest usable hit for a sequence of `num_tokens` tokens with fine keys `hashes` (no side effects)."""
        hit = Hit()
        limit = min(len(hashes), (num_tokens - 1) // self.h)
        entries: list[tuple[int, int] | None] = []
        for j in range(limit):
            e = self.mla.get(hashes[j])
            if e is None:
                if self.host is None or hashes[j] not in self.host.mla:
                    break
            entries.append(e)
        hit.mla_run = len(entries) * self.h
        for j in range(len(entries), 0, -1):
            key = hashes[j - 1]
            if key in self.ckpt or (self.host is not None and key in self.host.ckpt):
                break
        else:
            return hit
        L = j * self.h
        hit.num_tokens = L
        needed = [hashes[i] for i in range(j) if entries[i] is None]
        if hashes[j - 1] not in self.ckpt:
            needed.append(hashes[j - 1])
        if needed:  # part of the hit lives in host memory: the engine fetches it, then looks up again
            hit.host_keys = needed
            return hit
        m = self.B // self.h
        hit.full_pages = [entries[(b + 1) * m - 1][0] for b in range(L // self.B)]
        r = L % self.B
        if r:
            page, rows = entries[j - 1]
            assert rows == r, (rows, r)
            hit.partial = (page, r)
        hit.checkpoint = self.ckpt[hashes[j - 1]]
        return hit

    def fetch(self, keys: list[bytes], alloc) -> bool:
        """Bring host-tier entries for `keys` back into device pages from `alloc()` (None = no page).
        Whole blocks move back with all their keys; returns False if a page could not be had.
        (An entry is taken out of the host tier before allocating, since allocating may evict into it.)"""
        host = self.host
        for key in keys:
            if key in host.mla and key not in self.mla:
                buf, bkeys = host.take_block(host.mla[key][0])
                page = alloc()
                if page is None:
                    host.put_block(buf, bkeys)
                    return False
                self.pool.flush()  # copies the pool still holds back run first (`PagePool.defer`)
                self.pool.mla[page, :, :buf.shape[1]].copy_(buf)
                for k, r in bkeys:
                    self.register_block(k, page, r)
                self.pool.decref(page)  # the cache's reference (taken in register_block) keeps it
            if key in host.ckpt and key not in self.ckpt:
                buf = host.take_checkpoint(key)
                page = alloc()
                if page is None:
                    host.put_checkpoint(key, buf)
                    return False
                self.pool.from_host(buf, page)
                self.register_checkpoint(key, page)
        return True

    def touch(self, pages) -> None:
        for p in pages:
            if p in self.lru:
                self.lru.move_to_end(p)

    # ---- registration ------------------------------------------------------------------------------
    def register_block(self, key: bytes, page: int, rows: int) -> None:
        """The rows [0, rows) of `page` hold the prefix named by `key` (no-op if the key is cached)."""
        if key in self.mla:
            return
        self.mla[key] = (page, rows)
        if page not in self.page_keys:
            self.page_keys[page] = []
            self.pool.incref(page)
            self.lru[page] = None
        self.page_keys[page].append(key)
        self.lru.move_to_end(page)

    def register_checkpoint(self, key: bytes, page: int) -> bool:
        """Take over the caller's reference to KDA slot `page` as the checkpoint at `key`.
        Returns False (caller keeps its reference) if a checkpoint for `key` exists."""
        if key in self.ckpt:
            return False
        self.ckpt[key] = page
        self.ckpt_key[page] = key
        self.lru[page] = None
        return True

    # ---- eviction ----------------------------------------------------------------------------------
    def evict_one(self) -> bool:
        """Evict the least recently used page that only the cache holds. False if there is none.

        A page a running sequence still holds counts as just used: it goes to the back of the LRU as the scan
        passes it, so the next scan does not walk it again (amortised O(1) per eviction; with every cached page
        of 256 running long prompts in front, each scan used to walk them all: ≈ 1 ms per allocation)."""
        lru, refcount = self.lru, self.pool.refcount
        for _ in range(len(lru)):
            p = next(iter(lru))
            if refcount[p] == 1:
                self._evict(p)
                return True
            lru.move_to_end(p)
        return False

    def _evict(self, p: int) -> None:
        self.evictions += 1
        if p in self.ckpt_key:
            if self.host is not None:
                self.host.store_checkpoint(self.ckpt_key[p], p)
            self.drop_checkpoint(self.ckpt_key[p])
            return
        keys = self.page_keys.pop(p)
        if self.host is not None:
            self.host.store_block(p, [(k, self.mla[k][1]) for k in keys])
        for k in keys:
            del self.mla[k]
            if k in self.ckpt:  # rule 3: a checkpoint goes with its MLA rows
                cp = self.ckpt[k]
                if self.host is not None:
                    self.host.store_checkpoint(k, cp)
                self.drop_checkpoint(k)
        del self.lru[p]
        self.pool.decref(p)

    def drop_checkpoint(self, key: bytes) -> None:
        p = self.ckpt.pop(key)
        del self.ckpt_key[p]
        del self.lru[p]
        self.pool.decref(p)

    def clear(self) -> None:
        """Drop every cached entry (pages still used by sequences stay with them)."""
        for p in list(self.ckpt_key):
            self.drop_checkpoint(self.ckpt_key[p])
        for p in list(self.page_keys):
            del self.page_keys[p], self.lru[p]
            self.pool.decref(p)
        self.mla.clear()
        self.recent.clear()
        if self.host is not None:
            self.host.clear()

    @property
    def num_pages(self) -> int:
        return len(self.lru)

    @property
    def num_evictable(self) -> int:
        return sum(self.pool.refcount[p] == 1 for p in self.lru)


class HostTier:
    """Idle prefixes written back to host memory on eviction and fetched again on reuse.

    An evicted MLA page is stored once (its valid rows) with all its keys, and the checkpoints registered
    under those keys go with it (KDA state travels with its MLA block); a checkpoint evicted on its own is
    stored alone. One LRU over stored items; dropping a block drops the checkpoints under its keys.
    """

    def __init__(self, pool: PagePool, capacity_bytes: int):
        self.pool, self.capacity = pool, capacity_bytes
        self.items: OrderedDict[tuple, int] = OrderedDict()  # ("blk", id) | ("ckpt", key) -> bytes
        self.blocks: dict[int, tuple[torch.Tensor, list[tuple[bytes, int]]]] = {}
        self.mla: dict[bytes, tuple[int, int]] = {}  # key -> (block id, rows)
        self.ckpt: dict[bytes, torch.Tensor] = {}
        self._next = 0
        self.used = 0
        self.stores = self.loads = 0

    def store_block(self, page: int, keys: list[tuple[bytes, int]]) -> None:
        rows = max(r for _, r in keys)
        self.pool.flush()
        self.put_block(self.pool.mla[page, :, :rows].to("cpu", copy=True), keys)

    def put_block(self, buf: torch.Tensor, keys: list[tuple[bytes, int]]) -> None:
        bid, self._next = self._next, self._next + 1
        self.blocks[bid] = (buf, keys)
        for k, r in keys:
            self.mla[k] = (bid, r)
        self._add(("blk", bid), buf.numel() * buf.element_size())

    def store_checkpoint(self, key: bytes, page: int) -> None:
        if key not in self.ckpt:
            self.put_checkpoint(key, self.pool.to_host(page, self.pool.layout.slot_bytes))

    def put_checkpoint(self, key: bytes, buf: torch.Tensor) -> None:
        self.ckpt[key] = buf
        self._add(("ckpt", key), buf.numel())

    def _add(self, item: tuple, nbytes: int) -> None:
        self.items[item] = nbytes
        self.used += nbytes
        self.stores += 1
        while self.used > self.capacity and self.items:
            self._drop(next(iter(self.items)))

    def _drop(self, item: tuple) -> None:
        self.used -= self.items.pop(item)
        if item[0] == "ckpt":
            del self.ckpt[item[1]]
            return
        _, keys = self.blocks.pop(item[1])
        for k, _ in keys:
            if self.mla.get(k, (None,))[0] == item[1]:
                del self.mla[k]
            if ("ckpt", k) in self.items:
                self._drop(("ckpt", k))

    def take_block(self, bid: int) -> tuple[torch.Tensor, list[tuple[bytes, int]]]:
        """Remove a block (not its checkpoints) for loading back into a device page."""
        buf, keys = self.blocks[bid]
        self.used -= self.items.pop(("blk", bid))
        del self.blocks[bid]
        for k, _ in keys:
            if self.mla.get(k, (None,))[0] == bid:
                del self.mla[k]
        self.loads += 1
        return buf, keys

    def take_checkpoint(self, key: bytes) -> torch.Tensor:
        self.used -= self.items.pop(("ckpt", key))
        self.loads += 1
        return self.ckpt.pop(key)

    def clear(self) -> None:
        self.items.clear(), self.blocks.clear(), self.mla.clear(), self.ckpt.clear()
        self.used = 0
