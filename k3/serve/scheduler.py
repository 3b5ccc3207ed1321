"""Continuous-batching scheduler: which tokens of which sequences go into the next forward, and the pages
they need.

Each step: running sequences first, oldest first (a decode = 1 token, an unfinished prefill = the next
chunk), then admissions from the waiting queue, all under `max_num_batched_tokens`. A prefill chunk ends at
the prompt end, at the budget, or at the next wanted KDA checkpoint position (so the state there can be
copied out after the forward: vLLM's "align" idea). When a running sequence needs a page and none can be
had even after evicting idle cache pages, the youngest running sequence is preempted (its pages freed, its
tokens recomputed later — usually from the prefix cache, since its blocks and a checkpoint at its last fine
boundary stay cached). Admission picks, among the first `affinity_window` waiting requests, the one with the
longest prefix hit (cache affinity), with aging so that the head of the queue is not skipped for ever; a
request whose prefix a running sequence is about to checkpoint waits for it rather than recomputing it.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable

from ..ops.kda import STATES_AT_MULTIPLE
from .pool import PagePool
from .prefix_cache import Hit, PrefixCache
from .request import Sequence


@dataclass
class Work:
    seq: Sequence
    start: int
    n: int
    sample: bool  # the chunk ends at the last token: its logits give the next token
    ckpts: list[tuple[int, int]] = field(default_factory=list)  # (position, slot): KDA checkpoints inside the chunk


class Scheduler:
    def __init__(self, pool: PagePool, cache: PrefixCache | None, hash_block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, checkpoint_interval: int = 0, affinity_window: int = 16,
                 checkpoints_in_chunks: bool = True):
        self.pool, self.cache = pool, cache
        self.B = pool.layout.block_size
        self.h = hash_block_size
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.interval, self.window = checkpoint_interval, affinity_window
        self.in_chunk = checkpoints_in_chunks  # see EngineConfig.checkpoints_in_chunks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._head_skips = 0
        self._served: dict[object, int] = {}  # group → admission tick of its latest admitted sequence
        self._tick = 0
        self.num_preemptions = 0
        self.suspects: set[Sequence] = set()  # in a failed batch: each runs alone in its next step
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0     # of which served from the cache
        self.checkpoints_saved = 0

    # ---- pages ---------------------------------------------------------------------------------------
    def alloc(self) -> int | None:
        """A page, evicting idle cached pages (LRU) if needed; None when nothing can be freed."""
        while not self.pool.num_free:
            if self.cache is None or not self.cache.evict_one():
                return None
        return self.pool.allocate()

    def _grow(self, seq: Sequence, end: int) -> bool:
        """Make sure seq has MLA pages for positions [0, end). False if a page could not be had."""
        while len(seq.mla_pages) * self.B < end:
            p = self.alloc()
            if p is None:
                return False
            seq.mla_pages.append(p)
        return True

    def release(self, seq: Sequence) -> None:
        """Give back a sequence's pages; its decode snapshot becomes a cached checkpoint."""
        if seq.snap_page is not None:
            kept = (self.cache is not None and seq.cacheable and seq.snap_pos // self.h <= seq.num_registered
                    and self.cache.register_checkpoint(seq.hashes[seq.snap_pos // self.h - 1], seq.snap_page))
            if kept:
                self.checkpoints_saved += 1
            else:
                self.pool.decref(seq.snap_page)
            seq.snap_page = None
        for p in seq.mla_pages:
            self.pool.decref(p)
        if seq.state_page is not None:
            self.pool.decref(seq.state_page)
        seq.mla_pages, seq.state_page = [], None
        seq.num_computed = seq.num_registered = seq.snap_pos = 0
        seq.ckpt_positions = []

    # ---- admission -------------------------------------------------------------------------------------
    def _lookup(self, seq: Sequence) -> Hit:
        if self.cache is None:
            return Hit()
        self.cache.recent.extend(seq.hashes, seq)
        return self.cache.lookup(seq.hashes, seq.num_tokens)

    def _restore(self, seq: Sequence) -> bool:
        """Copy a paused sequence's state (`seq.restore`, host memory) into fresh pages. False if out of pages."""
        r = seq.restore
        n = r.num_computed
        pages = []
        for _ in range(1 + -(-n // self.B)):
            p = self.alloc()
            if p is None:
                for q in pages:
                    self.pool.decref(q)
                return False
            pages.append(p)
        state, seq.mla_pages = pages[0], pages[1:]
        self.pool.from_host(r.kda_slot, state)
        for i, p in enumerate(seq.mla_pages):
            rows = r.mla_rows[:, i * self.B:(i + 1) * self.B]
            self.pool.mla[p, :, :rows.shape[1]].copy_(rows)
        seq.state_page, seq.num_computed, seq.ckpt_positions, seq.restore = state, n, [], None
        seq.cacheable = False  # nothing it computes goes into the prefix cache (its history may be older weights')
        return True

    def _admit(self, seq: Sequence) -> bool:
        """Restore the deepest prefix hit into fresh pages for seq (or its paused state, `_restore`). False
        (nothing changed) if out of pages."""
        if seq.restore is not None:
            return self._restore(seq)
        hit = self._lookup(seq)
        if hit.host_keys:
            if not self.cache.fetch(hit.host_keys, self.alloc):
                hit = Hit(mla_run=hit.mla_run)
            else:
                hit = self.cache.lookup(seq.hashes, seq.num_tokens)
                if hit.host_keys:
                    hit = Hit(mla_run=hit.mla_run)
        pins = list(hit.full_pages)  # rule 1: pin every page of the hit before allocating anything
        if hit.partial:
            pins.append(hit.partial[0])
        if hit.checkpoint is not None:
            pins.append(hit.checkpoint)
        for p in pins:
            self.pool.incref(p)
        state = self.alloc()
        copy = self.alloc() if (hit.partial and state is not None) else None
        if state is None or (hit.partial and copy is None):
            for p in pins + [x for x in (state, copy) if x is not None]:
                self.pool.decref(p)
            return False
        # rule 2: copies on the device, before the forward that reads them
        if hit.checkpoint is not None:
            self.pool.copy_slot(hit.checkpoint, state)
            self.pool.decref(hit.checkpoint)
        else:
            self.pool.zero_slot(state)
        seq.mla_pages = list(hit.full_pages)
        if hit.partial:
            self.pool.copy_tokens(hit.partial[0], copy, hit.partial[1])
            self.pool.decref(hit.partial[0])
            seq.mla_pages.append(copy)
        if self.cache is not None:
            self.cache.touch(pins)
        L = hit.num_tokens
        seq.state_page, seq.num_computed, seq.num_registered = state, L, L // self.h
        N = seq.num_tokens
        want = {(N - 1) // self.h * self.h, N // self.h * self.h}  # end of prompt (and its last full block)
        if hit.mla_run > L:
            want.add(hit.mla_run)  # shared-prefix junction
        if self.interval:
            want.update(range(self.interval * self.h, N + 1, self.interval * self.h))
        seq.ckpt_positions = sorted(x for x in want if L < x <= N) if self.cache is not None else []
        P = len(seq.prompt_ids)
        self.prefix_queries += P
        self.prefix_hits += min(L, P)
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = min(L, P)
        return True

    def _pending_keys(self) -> set[bytes]:
        """Keys of the checkpoints running sequences are about to store."""
        return {k for s in self.running for k in self._future_keys(s)}

    def _future_keys(self, seq: Sequence) -> list[bytes]:
        return [seq.hashes[x // self.h - 1] for x in seq.ckpt_positions
                if x > seq.num_computed and x // self.h <= len(seq.hashes)]

    def _deferred(self, seq: Sequence, pending: set[bytes]) -> bool:
        """Wait for a checkpoint a running sequence is computing right now (e.g. the same prompt sampled
        several times, or an RL group) instead of recomputing the same prefix in parallel."""
        if not pending or seq.preempted:
            return False
        self.cache.recent.extend(seq.hashes, seq)
        for j in range(min(len(seq.hashes), (seq.num_tokens - 1) // self.h), 0, -1):
            if seq.hashes[j - 1] in pending:
                return j * self.h > self._lookup(seq).num_tokens
        return False

    def _pick(self, pending: set[bytes]) -> Sequence | None:
        """Next request to admit: among the first `affinity_window` waiting requests that are not waiting
        for a pending checkpoint, the one with the longest prefix hit (the head after `window` skips)."""
        affinity = self.cache is not None and self.window > 1
        cands = []
        for seq in islice(self.waiting, 0, 4 * max(self.window, 1)):
            if not self._deferred(seq, pending):
                cands.append(seq)
                if len(cands) >= (self.window if affinity else 1):
                    break
        if not cands:
            return None
        head = best = cands[0]  # (a lone candidate: nothing to compare, its lookup is its admission's)
        if affinity and len(cands) > 1 and not head.preempted and self._head_skips < self.window:
            best_hit = self._lookup(head).num_tokens
            for seq in cands[1:]:
                if seq.preempted:
                    continue
                L = self._lookup(seq).num_tokens
                if L > best_hit:
                    best, best_hit = seq, L
        self._head_skips = 0 if best is head else self._head_skips + 1
        self.waiting.remove(best)
        return best

    @staticmethod
    def _group(seq: Sequence) -> object:
        return seq.group if seq.group is not None else ("request", seq.request_id)

    def _fair_order(self) -> None:
        """Reorder `waiting` round-robin between groups (see the module docstring); O(waiting)."""
        front: list[Sequence] = []
        groups: dict[object, list[Sequence]] = {}   # in order of first appearance
        for seq in self.waiting:
            if seq.preempted:
                front.append(seq)
            else:
                groups.setdefault(self._group(seq), []).append(seq)
        self._served = {g: t for g, t in self._served.items() if g in groups}
        if len(groups) < 2:
            return
        order = sorted(groups, key=lambda g: self._served.get(g, -1))  # stable: ties keep first appearance
        out = front
        for j in range(max(len(v) for v in groups.values())):
            out.extend(groups[g][j] for g in order if j < len(groups[g]))
        self.waiting.clear()
        self.waiting.extend(out)

    def _chunk_end(self, seq: Sequence, budget: int) -> int:
        """Where seq's next chunk ends: the prompt end, the budget, or a wanted checkpoint position (with
        `checkpoints_in_chunks`, only one the forward cannot store from inside the chunk: not a multiple of
        `STATES_AT_MULTIPLE` tokens into it)."""
        end = min(seq.num_tokens, seq.num_computed + budget)
        for x in seq.ckpt_positions:
            inside = self.in_chunk and x < end and (x - seq.num_computed) % STATES_AT_MULTIPLE == 0
            if x > seq.num_computed and not inside:
                return min(end, x)
        return end

    def _work(self, seq: Sequence, end: int) -> Work:
        """The chunk [num_computed, end) of seq, with a fresh slot for each wanted checkpoint strictly inside it
        (the forward writes the KDA state there; `after_forward` registers it). A checkpoint is skipped when
        the cache already has it or no page is free."""
        w = Work(seq, seq.num_computed, end - seq.num_computed, end == seq.num_tokens)
        if self.cache is None or not seq.cacheable or not self.in_chunk:
            return w
        for x in seq.ckpt_positions:
            if seq.num_computed < x < end and x // self.h <= len(seq.hashes) \
                    and seq.hashes[x // self.h - 1] not in self.cache.ckpt:
                page = self.alloc()
                if page is None:
                    break
                w.ckpts.append((x, page))
        return w

    def drop_checkpoints(self, work: list[Work]) -> None:
        """Give back the checkpoint slots of a forward that did not run."""
        for w in work:
            for _, page in w.ckpts:
                self.pool.decref(page)
            w.ckpts = []

    def _push_waiting_front(self, seq: Sequence) -> None:
        """Preempted sequences go back to the front of the queue, oldest first."""
        i = 0
        while i < len(self.waiting) and self.waiting[i].preempted and self.waiting[i].order < seq.order:
            i += 1
        self.waiting.insert(i, seq)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.preempted += 1
        self.num_preemptions += 1
        self._push_waiting_front(seq)

    # ---- the step ---------------------------------------------------------------------------------------
    def _solo(self) -> list[Work] | None:
        """After a failed forward: the next suspect (see `Engine._forward_failed`) alone in a step (running
        sequences wait one step, their state intact). None when no suspect is waiting or it cannot be admitted
        (it is then scheduled normally)."""
        self.suspects = {s for s in self.suspects if s in self.waiting}
        seq = next((s for s in self.waiting if s in self.suspects), None)
        if seq is None:
            return None
        self.suspects.discard(seq)
        self.waiting.remove(seq)
        if not self._admit(seq):
            self._return(seq)
            return None
        end = self._chunk_end(seq, self.budget)
        if not self._grow(seq, end):
            self.release(seq)
            self._return(seq)
            return None
        bisect.insort(self.running, seq, key=lambda s: s.order)
        return [self._work(seq, end)]

    def schedule(self) -> list[Work]:
        if self.suspects:
            solo = self._solo()
            if solo is not None:
                return solo
        budget = self.budget
        work: list[Work] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            end = self._chunk_end(seq, budget)
            while not self._grow(seq, end):
                self.preempt(self.running[-1])  # the youngest; possibly seq itself
                if seq.state_page is None:
                    break
            if seq.state_page is None:
                continue
            work.append(self._work(seq, end))
            budget -= end - seq.num_computed
            i += 1
        pending = self._pending_keys() if self.cache is not None and self.waiting else set()
        if self.waiting and budget > 0 and len(self.running) < min(self.max_num_seqs, self.budget):
            self._fair_order()
        while self.waiting and budget > 0 and len(self.running) < min(self.max_num_seqs, self.budget):
            seq = self._pick(pending)
            if seq is None:
                break
            if not self._admit(seq):
                self._return(seq)
                break
            end = self._chunk_end(seq, budget)
            if not self._grow(seq, end):
                self.release(seq)
                self._return(seq)
                break
            bisect.insort(self.running, seq, key=lambda s: s.order)
            self._served[self._group(seq)] = self._tick
            self._tick += 1
            if self.cache is not None:
                pending.update(self._future_keys(seq))
            work.append(self._work(seq, end))
            budget -= end - seq.num_computed
        return work

    def schedule_continuation(self, pending: list[Sequence], ends: Callable[[Sequence], bool]) -> list[Work] | None:
        """Asynchronous scheduling: the next step while the tokens of `pending` (the sequences the step in flight
        sampled) are still on the device: one decode each of those tokens, at position num_computed. None
        (the engine then completes the step in flight and calls `schedule`) when a running sequence is not
        among them (a prefill chunk is due), an admission may be due, a failed batch is being bisected, or a
        page cannot be had without preemption. Sequences whose pending token ends them (`ends`: by length)
        are left out."""
        if self.suspects or (self.waiting and len(self.running) < min(self.max_num_seqs, self.budget)):
            return None
        ids = set(pending)
        if any(seq not in ids or seq.num_computed != seq.num_tokens for seq in self.running):
            return None
        work = []
        for seq in self.running:
            if ends(seq):
                continue
            if not self._grow(seq, seq.num_computed + 1):
                return None
            work.append(Work(seq, seq.num_computed, 1, True))
        return work if 0 < len(work) <= self.budget else None

    def _return(self, seq: Sequence) -> None:
        if seq.preempted:
            self._push_waiting_front(seq)
        else:  # before the first younger non-preempted sequence (arrival order within its group)
            i = next((k for k, s in enumerate(self.waiting) if not s.preempted and s.order > seq.order),
                     len(self.waiting))
            self.waiting.insert(i, seq)

    def after_forward(self, work: list[Work]) -> None:
        """Advance the computed counts; register completed fine blocks and wanted checkpoints."""
        h, cache = self.h, self.cache
        for w in work:
            seq = w.seq
            seq.num_computed += w.n
            if cache is None or not seq.cacheable:
                self.drop_checkpoints([w])
                continue
            X = seq.num_computed
            while seq.num_registered < len(seq.hashes) and (seq.num_registered + 1) * h <= X:
                j = seq.num_registered
                cache.register_block(seq.hashes[j], seq.mla_pages[j * h // self.B], (j % (self.B // h) + 1) * h)
                seq.num_registered += 1
            for x, page in w.ckpts:  # written by the forward inside the chunk
                if x // h <= seq.num_registered and cache.register_checkpoint(seq.hashes[x // h - 1], page):
                    self.checkpoints_saved += 1
                else:
                    self.pool.decref(page)
            w.ckpts = []
            while seq.ckpt_positions and seq.ckpt_positions[0] < X:
                seq.ckpt_positions.pop(0)
            if seq.ckpt_positions and seq.ckpt_positions[0] == X:
                seq.ckpt_positions.pop(0)
                self._checkpoint(seq, X)
            elif w.n == 1 and X % h == 0 and X // h <= seq.num_registered:
                if seq.snap_page is None:
                    seq.snap_page = self.alloc()
                if seq.snap_page is not None:
                    self.pool.copy_slot(seq.state_page, seq.snap_page)
                    seq.snap_pos = X

    def _checkpoint(self, seq: Sequence, X: int) -> None:
        if X // self.h > seq.num_registered:
            return
        key = seq.hashes[X // self.h - 1]
        if key in self.cache.ckpt:
            return
        page = self.alloc()
        if page is None:
            return
        self.pool.copy_slot(seq.state_page, page)
        self.cache.register_checkpoint(key, page)
        self.checkpoints_saved += 1

    def on_token(self, seq: Sequence) -> None:
        """A token was appended to seq: hash the fine block it completed, if any."""
        if self.cache is not None and seq.num_tokens % self.h == 0:
            self.cache.recent.extend(seq.hashes, seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted), releasing its pages."""
        self.suspects.discard(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
