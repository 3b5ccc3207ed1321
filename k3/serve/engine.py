"""`Engine`: the in-process serving engine (submit / step / abort / generate) over the paged pool, the
KDA-aware prefix cache, the continuous-batching scheduler and the model runner.

RL "resume": abort a request (the returned output has the partial tokens and their log-probs), then submit
`prompt + partial tokens` as a new prompt. The prefix cache makes this cheap: the aborted sequence's MLA
blocks stay cached and its KDA state at the last fine-block boundary it passed becomes a checkpoint, so
only the tokens after that boundary are recomputed.

Asynchronous scheduling (`EngineConfig.async_scheduling`, vLLM's name): a step's sampled tokens stay on the
device while the next step is scheduled and launched; that step's decodes read their input ids there
(`ModelRunner.last_tokens`), and the host turns the previous step's tokens into outputs while the GPU runs the
new one. `step()` therefore returns the outputs of the step before the one it launched. A continuation is
launched only when every running sequence is a decode of the step in flight and no admission is due; a
sequence that turns out to have finished (EOS, stop string) was computed once more for nothing, and its
pages, released meanwhile, are only reused by work queued after that forward. Anything else (prefill chunks,
admissions, preemption) first completes the step in flight, as the synchronous engine does.

Thread safety: step() and abort() hold the engine lock; submit() only touches an inbox (under its own
lock) that the next step drains, so a server may submit from request handlers while a loop thread steps.
"""

from __future__ import annotations

import atexit
import copy
import functools
import gc
import logging
import threading
import uuid
from array import array
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..model.layers import refresh_joined_weights
from ..model.moe import fuse_gate_up
from ..ops.kda import BACKENDS as KDA_BACKENDS
from .pool import PagePool, PoolLayout
from .prefix_cache import PrefixCache
from .request import PausedRequest, RequestOutput, SamplingParams, Sequence
from .runner import ModelRunner, SeqInput, text_model
from .sampling import sample_device
from .stop import first_stop
from .scheduler import Scheduler

log = logging.getLogger("k3.serve.engine")
MAX_FORWARD_FAILURES = 3  # forwards a sequence may be part of that fail before it is failed itself


@dataclass
class EngineConfig:
    """Engine settings. Sizes in tokens unless named otherwise.

    block_size: tokens per MLA page (the coarse physical block, default 6144).
    hash_block_size: fine prefix-hash block (default 512); must divide block_size.
    num_pages: pool pages; None = from `pool_bytes`, else (CUDA) `gpu_memory_fraction` of the free memory,
        else (CPU) 256 MiB.
    max_num_seqs / max_num_batched_tokens: batch limits per step (sequences / tokens incl. prefill chunks);
        at most max_num_batched_tokens sequences run at once (each decode needs one token of the budget).
    max_model_len: prompt + output limit (None = the model's max_position_embeddings).
    checkpoint_interval: also keep a KDA checkpoint every this many fine blocks of a prompt (0 = only the
        sparse endpoints: end of prompt, shared-prefix junction, last boundary of a finished sequence).
    checkpoints_in_chunks: write wanted KDA checkpoints from inside a prefill chunk (the chunked kernel's
        `states_at`) instead of ending the chunk there: one forward fewer per checkpoint (8K-token prefill on
        the H200: 78k → 122k tok/s). A checkpoint that is not a multiple of 16 tokens into its chunk still
        ends the chunk. False: every checkpoint ends a chunk (the earlier behaviour).
    host_cache_bytes: host-memory tier for evicted prefixes (0 = off).
    affinity_window: how many waiting requests admission considers for the longest prefix hit.
    detokenize: token ids → text, needed for `SamplingParams.stop` strings.
    kda_backend: KDA kernel backend of the engine's forwards ("auto": each KDA module's own `backend`;
        "torch" / "reference" also select the PyTorch decode step).
    record_logits: keep every sampled position's fp32 logits in `Engine.recorded_logits` (tests, debugging).
    cuda_graphs: replay captured CUDA graphs for pure decode steps on CUDA (`runner.DecodeGraph`; reserves two
        pool pages). The graphs hold the weights' addresses: update weights in place (`load_state_dict`,
        `copy_`), never by assigning new tensors.
    async_scheduling: overlap the host's work (scheduling, outputs) with the GPU's forward: `step()` launches
        the next decode step before reading back the previous step's tokens and returns the previous step's
        outputs (see the module docstring). False: each step's outputs come from that step (one
        device→host wait per step).
    gc_freeze: after construction, collect and then move every live object to Python's permanent GC generation
        (`gc.freeze()`, as vLLM does): otherwise a full collection now and then scans the model's and torch's
        ~300K objects (≈ 200 ms on a 2-core CPU) in the middle of a decode loop. Process-wide: meant for a
        process that serves (`k3 serve` sets it); objects alive at that point are never cyclic-collected.
    """
    block_size: int = 6144
    hash_block_size: int = 512
    num_pages: int | None = None
    pool_bytes: int | None = None
    gpu_memory_fraction: float = 0.8
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    checkpoint_interval: int = 0
    checkpoints_in_chunks: bool = True
    host_cache_bytes: int = 0
    affinity_window: int = 16
    detokenize: Callable[[list[int]], str] | None = None
    kda_backend: str = "auto"
    record_logits: bool = False
    cuda_graphs: bool = True
    async_scheduling: bool = True
    gc_freeze: bool = False

    def __post_init__(self):
        for name in ("block_size", "hash_block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {v!r}")
        if self.block_size % self.hash_block_size:
            raise ValueError(f"EngineConfig.hash_block_size ({self.hash_block_size}) must divide block_size "
                             f"({self.block_size})")
        if self.checkpoint_interval < 0 or self.host_cache_bytes < 0:
            raise ValueError("EngineConfig.checkpoint_interval and host_cache_bytes must be >= 0, got "
                             f"{self.checkpoint_interval} and {self.host_cache_bytes}")
        if self.kda_backend not in KDA_BACKENDS:
            raise ValueError(f"EngineConfig.kda_backend must be one of {KDA_BACKENDS}, got {self.kda_backend!r}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")


def _valid_ids(ids, vocab_size: int) -> array | None:
    """A non-empty list or tuple of integers in [0, vocab_size) as the int64 array `Engine.submit` keeps; None for
    anything else (`submit`'s own checks then convert it or raise). The fast path of a long prompt: array('Q')
    converts Python ints 2.7x faster than array('q') (its item setter skips the argument parser: 16K ids 90 against
    250 µs), and one unsigned max checks both bounds (a negative id is refused by 'Q'). Other iterables take
    `submit`'s path directly: an iterator cannot be read twice."""
    if not isinstance(ids, (list, tuple)):
        return None
    try:
        u = array("Q", ids)
    except Exception:  # whatever it is, `submit`'s path raises it again, with its own message
        return None
    if not u or np.frombuffer(u, dtype=np.uint64).max() >= vocab_size:
        return None
    q = array("q")
    q.frombytes(memoryview(u).cast("B"))  # the same bytes: every id is below 2**63
    return q


_INT_TYPECODES = frozenset("bBhHiIlLqQ")


def _buffer_ids(ids, vocab_size: int) -> array | None:
    """A 1-D integer NumPy array, torch tensor or `array.array` of ids as `submit`'s int64 array, converted through
    its buffer: no Python int per id (16K ids in ≈ 10 µs, against ≈ 100 µs from a list: a caller holding a
    prompt as an array skips that on a prefix hit's critical path). None for other types (lists take `_valid_ids`);
    ValueError naming what is wrong, with `_checked_ids`' messages for the same faults."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"prompt token ids must be integers, got a {ids.dtype} tensor")
        x = ids.detach().cpu().numpy()
    elif isinstance(ids, np.ndarray):
        x = ids
    elif isinstance(ids, array):
        if ids.typecode not in _INT_TYPECODES:
            raise ValueError(f"prompt token ids must be integers, got an array of typecode {ids.typecode!r}")
        x = np.frombuffer(ids, dtype=np.dtype(ids.typecode))
    else:
        return None
    if x.ndim != 1:
        raise ValueError(f"prompt token ids must be one sequence (1-D), got shape {tuple(x.shape)}")
    if x.dtype.kind not in "iu":
        raise ValueError(f"prompt token ids must be integers, got dtype {x.dtype}")
    _check_in_vocab(x, vocab_size)
    out = array("q")
    out.frombytes(memoryview(np.ascontiguousarray(x, dtype=np.int64)).cast("B"))
    return out


def _checked_ids(ids, vocab_size: int) -> array:
    """Any iterable of integers in [0, vocab_size) as an int64 array, else ValueError naming what is wrong: the
    general path of `Engine.submit` (and the oracle of `_valid_ids`)."""
    try:  # integers only (a float or a string is an error, not truncated or parsed), checked in C
        a = array("q", ids)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"prompt token ids must be integers: {e}") from None
    _check_in_vocab(np.frombuffer(a, dtype=np.int64), vocab_size)
    return a


def _check_in_vocab(x: np.ndarray, vocab_size: int) -> None:
    """ValueError unless the integer ids x are non-empty and all in [0, vocab_size), naming the first bad ones."""
    if not x.size:
        raise ValueError("prompt_token_ids is empty; need at least one token")
    if x.min() < 0 or x.max() >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got "
                         f"{x[(x < 0) | (x >= vocab_size)][:5].tolist()}")


@functools.cache
def _unfreeze_at_exit() -> None:
    """Once per process: at exit everything is collectable again (no "leaked" reports from extensions)."""
    atexit.register(gc.unfreeze)


class Engine:
    def __init__(self, model, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        self.model = model
        lm = text_model(model)
        if lm.training:
            raise ValueError("Engine needs a model in eval mode (call model.eval())")
        self.text_config = tc = lm.config
        fuse_gate_up(model)  # each expert's gate / up projections as one grouped GEMM (no copy, no extra memory)
        w = lm.lm_head.weight
        self.device, self.dtype = w.device, lm.model.embed_tokens.weight.dtype
        self.max_model_len = cfg.max_model_len or tc.max_position_embeddings
        layout = PoolLayout.for_model(tc, cfg.block_size, self.dtype)
        self.pool = PagePool(layout, self._num_pages(layout), self.device)
        self.cache = (PrefixCache(self.pool, cfg.hash_block_size, cfg.block_size, cfg.host_cache_bytes)
                      if cfg.enable_prefix_caching else None)
        self.scheduler = Scheduler(self.pool, self.cache, cfg.hash_block_size, cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens, cfg.checkpoint_interval, cfg.affinity_window,
                                   cfg.checkpoints_in_chunks)
        self.runner = ModelRunner(model, self.pool, cfg.kda_backend, cfg.cuda_graphs, cfg.max_num_seqs)
        eos = tc.eos_token_id
        self.eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        self.requests: dict[str, Sequence] = {}
        self.recorded_logits: dict[str, list[torch.Tensor]] = {}
        self._lock = threading.RLock()  # engine state (scheduler, pool, cache): held by step / abort
        self._inbox_lock = threading.Lock()  # `requests` and the submission inbox
        self._inbox: list[Sequence] = []
        self.num_finished = self.num_aborted = self.num_paused = 0
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.num_steps = 0
        self._inflight: _Inflight | None = None  # the step whose tokens are still on the device
        self._stash: list[RequestOutput] = []     # outputs completed outside step() (pause, weight updates)
        pin = self.device.type == "cuda"
        # flat, so that the first 2·n values are a contiguous [2, n]: a copy into a strided slice of pinned memory
        # goes through a pageable temporary, which blocks the host until the forward before it has finished
        self._host_ids = [torch.empty(2 * cfg.max_num_seqs, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self._dev_rows = torch.empty(2 * cfg.max_num_seqs, dtype=torch.float64, device=self.device)  # their source
        if cfg.gc_freeze:
            gc.collect()
            gc.freeze()
            _unfreeze_at_exit()

    def _num_pages(self, layout: PoolLayout) -> int:
        cfg = self.config
        if cfg.num_pages is not None:
            return cfg.num_pages
        if cfg.pool_bytes is not None:
            nbytes = cfg.pool_bytes
        elif self.device.type == "cuda":
            nbytes = int(torch.cuda.mem_get_info(self.device)[0] * cfg.gpu_memory_fraction)
        else:
            nbytes = 256 << 20
        return max(2, nbytes // layout.page_bytes)

    @classmethod
    def from_pretrained(cls, checkpoint_dir, config: EngineConfig | None = None, device=None,
                        dtype: torch.dtype | str | None = None) -> "Engine":
        from ..model.k3 import K3ForConditionalGeneration
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = K3ForConditionalGeneration.from_pretrained(checkpoint_dir, dtype=dtype, device=device)
        return cls(model.eval(), config)

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, prompt_token_ids: "list[int] | np.ndarray | torch.Tensor | array",
               params: SamplingParams | None = None, request_id: str | None = None, group: str | None = None) -> str:
        """Queue a request; returns its id. The prompt: a list or tuple of ints, or a 1-D integer NumPy array,
        torch tensor or `array.array` (read through its buffer: no per-id conversion). `group` (e.g. the server
        request a choice belongs to) makes admission round-robin between groups, so one large request cannot
        starve the others."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        V = self.text_config.vocab_size
        ids = _valid_ids(prompt_token_ids, V)
        if ids is None:  # an array or tensor through its buffer; else the general path converts it or says why not
            ids = _buffer_ids(prompt_token_ids, V)
        if ids is None:
            ids = _checked_ids(prompt_token_ids, V)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the limit is max_model_len - 1 = "
                             f"{self.max_model_len - 1}")
        if params.stop and self.config.detokenize is None:
            raise ValueError("stop strings need EngineConfig.detokenize")
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        need = -(-total // self.config.block_size) + 1
        usable = self.pool.num_pages - len(self.runner.reserved_pages)
        if need > usable:
            raise ValueError(f"a request of {total} tokens needs {need} pages but the pool has {usable}")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(request_id=rid, prompt_ids=ids, params=params, eos=() if params.ignore_eos else self.eos,
                       generator=gen, group=group)
        with self._inbox_lock:  # not the step lock: submitting never waits for a forward
            if rid in self.requests:
                raise ValueError(f"request id {rid!r} is already in flight")
            self.requests[rid] = seq
            self._inbox.append(seq)
            self.prompt_tokens_total += len(ids)
            if self.config.record_logits:
                self.recorded_logits[rid] = []
        return rid

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            self.scheduler.waiting.extend(self._inbox)
            self._inbox.clear()

    def _take(self, request_id: str) -> Sequence:
        """Remove a request from the in-flight table (step lock held); KeyError if unknown or finished."""
        self._drain_inbox()
        with self._inbox_lock:
            seq = self.requests.pop(request_id, None)
        if seq is None:
            raise KeyError(f"unknown or finished request id {request_id!r}")
        return seq

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now; returns its partial tokens (and log-probs) with finish_reason "abort".
        Raises KeyError for an unknown or already finished request."""
        with self._lock:
            seq = self._take(request_id)
            self.scheduler.remove(seq)
            seq.finished, seq.finish_reason = True, "abort"
            self.num_aborted += 1
            return seq.to_output()

    def pause(self, request_id: str) -> PausedRequest:
        """Take a request out with its model state, to be continued exactly by `resume` (RL partial rollout).

        A running request's KDA slot and the MLA rows of its computed positions are copied to host memory and
        its device pages freed; a waiting one (not admitted, or preempted) keeps no state and is recomputed on
        resume. Its tokens, log-probs and sampler generator travel in the returned `PausedRequest`. Raises
        KeyError for an unknown or finished request. A token still in flight (asynchronous scheduling) is
        completed first and belongs to the paused request (its output for it is not returned by `step()`)."""
        with self._lock:
            with self._inbox_lock:
                live = self.requests.get(request_id)
            emitted = None if live is None else live.emitted
            self._complete_inflight()
            if live is not None and not live.finished and live.emitted != emitted:
                self._stash = [o for o in self._stash if o.request_id != request_id]
                live.emitted = emitted  # its next output after `resume` carries the token again
            seq = self._take(request_id)
            if seq.restore is not None:  # resumed but not admitted since: still the same state
                paused = seq.restore
            elif seq in self.scheduler.running and seq.num_computed > 0:
                n, B = seq.num_computed, self.pool.layout.block_size
                kda = self.pool.to_host(seq.state_page, self.pool.layout.slot_bytes)
                mla = torch.cat([self.pool.mla[p, :, :min(B, n - i * B)]
                                 for i, p in enumerate(seq.mla_pages[:-(-n // B)])], dim=1).cpu()
                paused = PausedRequest(seq, n, kda, mla)
            else:
                paused = PausedRequest(seq, 0, None, None)
            seq.restore = None
            self.scheduler.remove(seq)
            self.num_paused += 1
            return paused

    def resume(self, paused: PausedRequest) -> str:
        """Continue a paused request from its saved state (no recomputation); returns its request id. The
        tokens it produces are those an uninterrupted run would have produced (same weights, same sampler
        state), and the finished output holds every token, before and after the pause."""
        if not isinstance(paused, PausedRequest):
            raise ValueError(f"resume takes a PausedRequest (from Engine.pause), got {type(paused).__name__}")
        seq = paused.seq
        if paused.num_computed:
            need = 1 + -(-paused.num_computed // self.pool.layout.block_size)
            if paused.mla_rows.shape[1] != paused.num_computed or need > self.pool.num_pages:
                raise ValueError(f"paused request {seq.request_id!r} does not fit this engine's pool")
        seq.restore = paused if paused.num_computed else None
        seq.finished, seq.finish_reason, seq.stop_reason = False, None, None
        with self._inbox_lock:
            if seq.request_id in self.requests:
                raise ValueError(f"request id {seq.request_id!r} is already in flight")
            self.requests[seq.request_id] = seq
            self._inbox.append(seq)
        return seq.request_id

    def update_weights(self, source) -> None:
        """Copy new weights (a module with this model's parameter names, or its state dict) into the engine's
        model IN PLACE — dtype converted, addresses kept, so captured CUDA graphs stay valid — and forget the
        prefix cache (computed with the old weights). Paused requests keep their old-weight states (partial
        rollout's off-policy segment). A no-op copy when `source` is the engine's own model."""
        with self._lock:
            self._complete_inflight()  # its tokens came from the old weights; its outputs wait in the stash
            if source is not self.model:
                sd = source.state_dict() if isinstance(source, torch.nn.Module) else source
                with torch.no_grad():
                    self.model.load_state_dict(sd, strict=True)
            refresh_joined_weights(self.model)  # joined projection weights the captured graphs read
            if self.cache is not None:
                self.cache.clear()

    def warm_up(self, prefill_tokens: list[int] | None = None, decode_batches: list[int] | None = None) -> list:
        """Capture the CUDA graphs the first requests would otherwise capture (and compile their kernels for):
        by default a prompt's first chunk of `max_num_batched_tokens` tokens and a batch-1 decode step (see
        `ModelRunner.warm_up`). Returns the runner's graph keys; none without graphs (CPU, fp32)."""
        budget = self.config.max_num_batched_tokens
        prefill = [budget] if prefill_tokens is None else list(prefill_tokens)
        with self._lock:
            return self.runner.warm_up(prefill, [1] if decode_batches is None else list(decode_batches))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (device and host tier). Call after changing the model's weights
        (e.g. an RL update): cached latents and KDA states were computed with the old ones. Pages held by
        running sequences stay with them."""
        with self._lock:
            if self.cache is not None:
                self.cache.clear()

    def has_unfinished(self) -> bool:
        """Whether `step()` still has work or outputs to return."""
        with self._inbox_lock:
            return bool(self.requests or self._stash)

    # ---- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: one forward launched, and the outputs of the requests that got tokens (or
        finished) in the step before it (with `async_scheduling`; else in this one)."""
        with self._lock:
            self._drain_inbox()
            outs, self._stash = self._stash, []
            prev, self._inflight = self._inflight, None
            work = None
            if prev is not None and self.config.async_scheduling:
                work = self.scheduler.schedule_continuation(prev.seqs, self._ends_with_pending)
            if work is None:  # not a continuation of the step in flight: complete that one first
                if prev is not None:
                    outs += self._finish(prev)
                    prev = None
                work = self.scheduler.schedule()
                if not work:
                    return outs
                work.sort(key=lambda w: w.n != 1)  # decodes first (the runner's packed layout)
            self.num_steps += 1
            src = {} if prev is None else {seq: i for i, seq in enumerate(prev.seqs)}
            inputs = [SeqInput(tokens=[0] if w.seq in src else w.seq.input_ids(w.start, w.n), start=w.start,
                               state_page=w.seq.state_page, mla_pages=w.seq.mla_pages, want_logits=w.sample,
                               checkpoints=[(x - w.start, page) for x, page in w.ckpts], src=src.get(w.seq, -1))
                      for w in work]
            try:
                logits = self.runner.forward(inputs)
                nxt = self._sample([w.seq for w in work if w.sample], logits)
            except BaseException as e:
                if prev is not None:  # the step before ran: its tokens are good
                    outs += self._finish(prev)
                    work = [w for w in work if not w.seq.finished]
                # some layers may have advanced these sequences' KDA slots: recompute them from scratch
                self.scheduler.drop_checkpoints(work)
                for w in work:
                    if w.seq in self.scheduler.running:
                        self.scheduler.preempt(w.seq)
                if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit
                    raise
                return outs + self._forward_failed([w.seq for w in work], e)
            if prev is not None:  # its tokens are this forward's inputs: read them while the GPU runs it
                outs += self._finish(prev)
                work = [w for w in work if not w.seq.finished]  # ended by those tokens: computed for nothing
            self.scheduler.after_forward(work)
            if nxt is not None:
                if self.config.async_scheduling:
                    self._inflight = nxt
                else:
                    outs += self._finish(nxt)
            return outs

    def _ends_with_pending(self, seq: Sequence) -> bool:
        """Whether the token seq has in flight ends it by length (so the next step need not compute it)."""
        return self._length_done(seq, pending=1)

    def _length_done(self, seq: Sequence, pending: int = 0) -> bool:
        """seq's output (plus `pending` tokens not yet on the host) reached max_tokens or max_model_len."""
        return len(seq.output) + pending >= seq.params.max_tokens or seq.num_tokens + pending >= self.max_model_len

    def _retire(self, seq: Sequence) -> None:
        """A finished request leaves the scheduler (its pages released) and the in-flight table."""
        self.scheduler.remove(seq)
        with self._inbox_lock:
            self.requests.pop(seq.request_id, None)

    def _sample(self, done: list[Sequence], logits: torch.Tensor) -> "_Inflight | None":
        """Sample the rows of `done` on the device, keep the ids for the next forward (`runner.published`) and
        start their copy to the host; `_finish` reads them."""
        if not done:
            return None
        n = len(done)
        rows = self._dev_rows[:2 * n].view(2, n)  # (ids, log p), fp64: ids < 2^53 exact
        # the picks also go to the next forward's device-fed ids and the read-back rows, in the sampling's own
        # kernels where it can (the greedy kernels: 5 small kernels fewer after each forward)
        sample_device(logits, [s.params for s in done], [s.generator for s in done], rows=rows,
                      last=self.runner.published(n))
        host = self.host_rows(n)
        host.copy_(rows, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        rec = logits.detach().clone() if self.config.record_logits else None  # a graph's output is reused
        return _Inflight(done, host, event, rec)

    def host_rows(self, n: int) -> torch.Tensor:
        """This step's pinned read-back buffer for n sampled rows, a contiguous [2, n] (ids, log-probs); two
        buffers alternate, so that the step in flight keeps its own."""
        return self._host_ids[self.num_steps % 2][:2 * n].view(2, n)

    def _finish(self, inf: "_Inflight") -> list[RequestOutput]:
        """The host's side of a sampled step: append each sequence's token, check stops, build outputs.
        Sequences that finished meanwhile (aborted, or ended by the step before) are skipped."""
        if inf.event is not None:
            for seq in inf.seqs:  # the outputs' prompt lists while the device works (16K ids: 0.2 ms)
                seq.output_prompt()
            inf.event.synchronize()
        host = inf.host.tolist()
        outs = []
        for i, (seq, t, lp) in enumerate(zip(inf.seqs, host[0], host[1])):
            if seq.finished:
                continue
            t = int(t)
            if t < 0:  # its logits were not finite: this request fails alone
                seq.finished, seq.finish_reason = True, "error"
                seq.stop_reason = "its logits were not finite (NaN / +inf); it cannot be sampled"
                self._retire(seq)
                outs.append(seq.to_output())
                continue
            if inf.logits is not None:
                self.recorded_logits[seq.request_id].append(inf.logits[i].cpu())
            seq.output.append(t)
            seq.logprobs.append(lp)
            self.scheduler.on_token(seq)
            self.generation_tokens_total += 1
            self._check_stop(seq, t)
            if seq.finished:
                self._retire(seq)
                self.num_finished += 1
            if seq.finished or seq.params.output_kind != "final_only":
                outs.append(seq.to_output())
        return outs

    def flush(self) -> list[RequestOutput]:
        """Complete the step in flight (asynchronous scheduling) and return the outputs not yet returned by
        `step()`: call before pausing requests whose tokens you track from the outputs."""
        with self._lock:
            self._complete_inflight()
            outs, self._stash = self._stash, []
            return outs

    def _complete_inflight(self) -> None:
        if self._inflight is not None:
            inf, self._inflight = self._inflight, None
            self._stash += self._finish(inf)

    def _forward_failed(self, seqs: list[Sequence], error: Exception) -> list[RequestOutput]:
        """A forward raised: find whose it was without failing the others. A forward of one sequence (or one
        that failed MAX_FORWARD_FAILURES times) fails that request alone (finish_reason "error"); the
        sequences of a larger failed batch become suspects, which the scheduler then runs one per step
        (`Scheduler.suspects`), so a request that breaks the model fails alone and every other continues."""
        log.warning("engine forward of %d sequence(s) failed: %s: %s", len(seqs), type(error).__name__, error)
        outs = []
        for seq in seqs:
            seq.failures += 1
            if len(seqs) > 1 and seq.failures < MAX_FORWARD_FAILURES:
                self.scheduler.suspects.add(seq)
                continue
            self.scheduler.suspects.discard(seq)
            seq.finished, seq.finish_reason = True, "error"
            seq.stop_reason = f"the model forward failed on this request: {type(error).__name__}: {error}"
            self._retire(seq)
            outs.append(seq.to_output())
        return outs

    def _check_stop(self, seq: Sequence, t: int) -> None:
        p = seq.params
        if t in seq.eos or t in p.stop_token_ids:
            seq.finished, seq.finish_reason, seq.stop_reason = True, "stop", t
            return
        if p.stop:
            longest = max(len(s) for s in p.stop)
            hit = first_stop(self.config.detokenize(seq.output[-(longest + 8):]), p.stop)
            if hit is not None:
                seq.finished, seq.finish_reason, seq.stop_reason = True, "stop", hit[1]
                return
        if self._length_done(seq):
            seq.finished, seq.finish_reason = True, "length"

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Blocking: run every prompt to completion; outputs in prompt order (each the cumulative final one:
        no intermediate outputs are built, whatever `output_kind` the params name)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        final_only = {}  # one copy per distinct params object, made without re-validating it (≈ 20 µs a `replace`)
        for sp in plist:
            if sp is not None and not isinstance(sp, SamplingParams):
                raise ValueError(f"params must be SamplingParams (or a list of them), got {type(sp).__name__}")
            if id(sp) not in final_only:
                final_only[id(sp)] = f = copy.copy(sp or SamplingParams())
                f.output_kind = "final_only"
        plist = [final_only[id(sp)] for sp in plist]
        rids = [self.submit(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        pending = set(rids)
        while pending:
            outs = self.step()
            for o in outs:
                if o.finished and o.request_id in pending:
                    final[o.request_id] = o
                    pending.discard(o.request_id)
            if not outs and not self.scheduler.running and not self.scheduler.waiting and not self._inbox:
                break
        return [final[r] for r in rids]

    def stats(self) -> dict:
        """Counters and gauges (vLLM-style names where one exists):

        running / waiting: requests; pool_pages_total / used / cached / evictable and pool_page_bytes;
        kv_cache_usage: fraction of pages held by sequences (idle cached pages count as free);
        prefix_cache_queries / hits: prompt tokens looked up / served from the cache, counted at every
        admission (a request re-admitted after preemption counts again); prefix_cache_checkpoints / blocks:
        cached KDA checkpoints / fine MLA keys; prefix_cache_evictions; host_cache_bytes; preemptions;
        checkpoints_saved; num_finished / num_aborted / num_paused / num_steps; prompt_tokens_total (submitted) and
        generation_tokens_total."""
        with self._lock:
            s, c = self.scheduler, self.cache
            return dict(
                running=len(s.running), waiting=len(s.waiting) + len(self._inbox),
                pool_pages_total=self.pool.num_pages, pool_pages_used=self.pool.num_used,
                pool_pages_cached=0 if c is None else c.num_pages,
                pool_pages_evictable=0 if c is None else c.num_evictable,
                pool_page_bytes=self.pool.layout.page_bytes,
                kv_cache_usage=(self.pool.num_used - (0 if c is None else c.num_evictable)) / self.pool.num_pages,
                prefix_cache_queries=s.prefix_queries, prefix_cache_hits=s.prefix_hits,
                prefix_cache_checkpoints=0 if c is None else len(c.ckpt),
                prefix_cache_blocks=0 if c is None else len(c.mla),
                prefix_cache_evictions=0 if c is None else c.evictions,
                host_cache_bytes=0 if c is None or c.host is None else c.host.used,
                preemptions=s.num_preemptions, checkpoints_saved=s.checkpoints_saved,
                num_finished=self.num_finished, num_aborted=self.num_aborted, num_paused=self.num_paused,
                num_steps=self.num_steps,
                prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            )

    def check_pool(self) -> None:
        """Pool accounting invariant (tests): every used page is owned by a running sequence or the cache."""
        with self._lock:
            self.pool.check()
            refs = [0] * self.pool.num_pages
            for p in self.runner.reserved_pages:
                refs[p] += 1
            for seq in self.scheduler.running:
                for p in seq.mla_pages + [seq.state_page] + ([seq.snap_page] if seq.snap_page is not None else []):
                    refs[p] += 1
            if self.cache is not None:
                for p in self.cache.lru:
                    refs[p] += 1
            if refs != self.pool.refcount:
                bad = [i for i, (a, b) in enumerate(zip(refs, self.pool.refcount)) if a != b]
                raise AssertionError(f"page reference counts disagree with owners at pages {bad[:10]}")


@dataclass(eq=False)
class _Inflight:
    """A sampled step whose token ids are still on their way to the host: `host` [2, n] (ids, log-probs; pinned
    on CUDA) is filled by an asynchronous copy that `event` marks; `logits` is a copy kept for record_logits."""
    seqs: list[Sequence]
    host: torch.Tensor
    event: "torch.cuda.Event | None"
    logits: torch.Tensor | None
