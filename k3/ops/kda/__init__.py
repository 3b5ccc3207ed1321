"""Kimi Delta Attention (KDA) ops, with `chunk_kda` / `chunk_kda_gated` as the dispatch points.

Backends: "triton" (k3's own Triton kernels, `k3.ops.kda.triton`: 16-token tiles that need K3's
lower-bounded gate, g >= -5), "fla" (fla.ops.kda.chunk_kda, Triton, CUDA only), "torch"
(chunk_kda_torch, chunked PyTorch with autograd, any device), "reference" (recurrent_kda, token
loop). "auto" on CUDA picks triton wherever it fits (head dims <= 128 and g >= -5), for training and inference:
on the H200 it is faster than fla's chunk_kda at every measured shape (forward 1.15-1.9x, forward+backward
1.07-1.27x); else fla when importable, else torch. For decode, triton. Figures: docs/benchmarks.md.
`states_at` (prefix-cache states): the Triton kernels emit them from the chunk loop; the other backends run
the pieces between the requested positions in turn (`states_at.py`). On CPU "auto" is torch. All share the fla contract:
q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; states [N, H, K, V] fp32 (K-first).
"""
from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint

from .._compile import eager_op
from .._triton import importable

from ._common import check_inputs
from .chunk import chunk_kda_torch
from .decode import fused_recurrent_kda as _fused_recurrent_torch
from .decode import kda_decode_step as _decode_step_torch
from .gate import kda_gate, l2norm
from .reference import recurrent_kda
from .states_at import STATES_AT_MULTIPLE, chunk_by_pieces, chunk_slots

__all__ = ["chunk_kda", "chunk_kda_gated", "chunk_kda_torch", "recurrent_kda", "fused_recurrent_kda",
           "kda_decode_step", "kda_decode_step_gated", "kda_gate", "l2norm", "fla_available", "triton_available",
           "BACKENDS", "STATES_AT_MULTIPLE", "EXTEND_CHUNKED_MIN_TOKENS", "extend_in_chunks", "chunk_slots"]

BACKENDS = ("auto", "fla", "torch", "reference", "triton")
# extend steps (a few new tokens per sequence, `kda_decode_step_gated` with cu_seqlens) take the chunked kernels
# from this many tokens per sequence on average (padding included), else the token-recurrent decode kernel (H200,
# k3-small, `benchmarks/probe/kda_extend.py`: tiles 1.10-1.16x faster at 8 per sequence, 3.0x at 64, 5.0x at 128)
EXTEND_CHUNKED_MIN_TOKENS = 8


def extend_in_chunks(num_tokens: int, num_seqs: int) -> bool:
    """Whether an extend step of `num_tokens` rows (padding included) over `num_seqs` sequences takes the chunked
    kernels (`EXTEND_CHUNKED_MIN_TOKENS`); `PackedBatch.for_extend` builds their tile tables only then."""
    return num_seqs > 0 and num_tokens >= EXTEND_CHUNKED_MIN_TOKENS * num_seqs
TRITON_G_MIN = -5.0  # the Triton tiles need every per-token log decay >= this (K3's lower bound)


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    """True when fla's KDA kernels import (tried once, on first use, not at k3 import time)."""
    try:
        from fla.ops.kda import chunk_kda as _  # noqa: F401
    except Exception:  # ImportError, or a broken triton/CUDA install
        return False
    return True


def triton_available() -> bool:
    """True when k3's Triton KDA kernels import (tried once, on first use)."""
    return importable(__name__ + ".triton")


def _triton_fits(q, v) -> bool:
    """auto's test for the Triton kernels: CUDA inputs, triton importable, head dims <= 128."""
    return q.is_cuda and q.shape[-1] <= 128 and v.shape[-1] <= 128 and triton_available()


def _fla_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                   use_qk_l2norm_in_kernel, **gate_kw):
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    return fla_chunk_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, **gate_kw)


def _auto_backend(q, v, in_range) -> str:
    """auto's choice, from the measurements (docs/benchmarks.md: H200, fla 0.6.0 in the same run): our Triton
    kernels wherever they fit -- faster than fla's chunk_kda at every measured shape, forward 1.15-1.9x and
    forward+backward 1.07-1.27x -- else fla on CUDA, else torch. in_range(): the gate-range check (g >= -5),
    called only when the kernels could run (it may read min(g) back from the device)."""
    if _triton_fits(q, v) and in_range():
        return "triton"
    if q.is_cuda and fla_available():
        return "fla"
    return "torch"


def _check_backend(fn, backend, q):
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if backend == "fla":
        if not q.is_cuda:
            raise ValueError(f"{fn}: backend 'fla' needs CUDA tensors")
        if not fla_available():
            raise ValueError(f"{fn}: backend 'fla' requested but fla is not importable")
    if backend == "triton":
        if not triton_available():
            raise ValueError(f"{fn}: backend 'triton' requested but triton is not importable")
        from .triton import interpreted
        if not q.is_cuda and not interpreted():
            raise ValueError(f"{fn}: backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), "
                             f"got {q.device}")


def _g_min(g, bound) -> float:
    """min(g): the caller's guaranteed bound if given, else read from the tensor (empty: 0)."""
    if bound is not None:
        return float(bound)
    return float(g.detach().min()) if g.numel() else 0.0


def _cu_on(cu_seqlens, q, backend):
    """cu_seqlens may live on the host (no device read: the Triton path builds its chunk tables from it); every
    other backend gets it on q's device."""
    if cu_seqlens is None or backend == "triton" or cu_seqlens.device == q.device:
        return cu_seqlens
    return cu_seqlens.to(q.device)


@eager_op
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm_in_kernel=False, backend="auto", states_at=None, g_lower_bound=None):
    """KDA over whole sequences (training and prefill); returns (o [B, T, H, V], final state or None).

    g is the activated per-token log decay (see `kda_gate`), beta is post-sigmoid; see the
    module docstring for shapes and `BACKENDS` for the choices of `backend`. `states_at` (any
    backend; one packed row): packed token positions, each a multiple of 16 tokens into its sequence or its end; the
    states there are returned as a third output [M, H, K, V] fp32 (for the serving prefix cache).
    `g_lower_bound`: a bound the caller guarantees for g (the model's gate: its lower bound), so the Triton
    path need not read min(g) back from the device (a host sync per call).
    """
    _check_backend("chunk_kda", backend, q)
    check_inputs("chunk_kda", q, k, v, g, beta, initial_state, cu_seqlens,
                 strict_state_dtype=backend != "reference")
    if backend == "auto":
        backend = _auto_backend(q, v, lambda: _g_min(g, g_lower_bound) >= TRITON_G_MIN)
    cu_seqlens = _cu_on(cu_seqlens, q, backend)
    args = (q, k, v, g, beta)
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if states_at is not None and backend != "triton":
        return chunk_by_pieces(functools.partial(chunk_kda, backend=backend, g_lower_bound=g_lower_bound),
                               *args, states_at, **kw)
    if backend == "triton":
        g_min = _g_min(g, g_lower_bound)
        if g_min < TRITON_G_MIN:
            raise ValueError(f"chunk_kda: backend 'triton' needs g >= {TRITON_G_MIN} (K3's lower-bounded gate) "
                             f"but min(g) = {g_min:.3g}; use backend 'fla' or 'torch'")
        from .triton import chunk_kda_triton
        return chunk_kda_triton(*args, states_at=states_at, **kw)
    if backend == "fla":
        return _fla_chunk_kda(*args, **kw)
    if backend == "reference":
        return recurrent_kda(*args, **kw)
    return chunk_kda_torch(*args, **kw)


@eager_op
def chunk_kda_gated(q, k, v, f, beta_logit, A_log, dt_bias=None, scale=None, initial_state=None,
                    output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=True,
                    lower_bound=-5.0, backend="auto", states_at=None):
    """KDA from the raw gate pre-activation f [B, T, H, K] and the beta logits [B, T, H].

    g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)) (K3's gate, `kda_gate`), beta =
    sigmoid(beta_logit); the triton backend fuses both (and the l2norm) into its kernels, with
    gradients for f, beta_logit, A_log [H] and dt_bias [H*K]; fla runs its in-kernel safe gate; torch
    and reference apply `kda_gate` and the sigmoid first. Returns as `chunk_kda`.
    """
    _check_backend("chunk_kda_gated", backend, q)
    check_inputs("chunk_kda_gated", q, k, v, f, beta_logit, initial_state, cu_seqlens,
                 strict_state_dtype=backend != "reference")
    if backend == "auto":
        backend = _auto_backend(q, v, lambda: TRITON_G_MIN <= lower_bound < 0)
    cu_seqlens = _cu_on(cu_seqlens, q, backend)
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if backend == "triton":
        from .triton import chunk_kda_gated_triton
        return chunk_kda_gated_triton(q, k, v, f, beta_logit, A_log, dt_bias, lower_bound=lower_bound,
                                      states_at=states_at, **kw)
    if backend == "fla" and states_at is None:
        return _fla_chunk_kda(q, k, v, f, beta_logit, A_log=A_log.reshape(-1), dt_bias=dt_bias,
                              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                              lower_bound=lower_bound, **kw)
    if not f.is_cuda and torch.is_grad_enabled() and backend != "reference":
        # memory-lean CPU training: the gate keeps only f for its backward (not its two [.., H, K] intermediates)
        g = torch.utils.checkpoint.checkpoint(kda_gate, f, A_log, dt_bias, lower_bound, use_reentrant=False)
    else:
        g = kda_gate(f, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_logit.float())
    if backend == "reference" or f.dtype == torch.float64:
        g, beta = g.to(torch.promote_types(g.dtype, f.dtype)), beta.to(torch.promote_types(beta.dtype, f.dtype))
    if states_at is not None:
        return chunk_kda(q, k, v, g, beta, backend=backend, states_at=states_at, g_lower_bound=lower_bound, **kw)
    return (recurrent_kda if backend == "reference" else chunk_kda_torch)(q, k, v, g, beta, **kw)


def _slots_contiguous(state) -> bool:
    """Every slot [H, K, V] of a state pool is contiguous (the pool itself may be a strided per-layer view)."""
    return state.dim() == 4 and state[0].is_contiguous() and state.stride(0) >= state[0].numel()


def _use_triton_decode(backend, q, state, *grad_inputs):
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown decode backend {backend!r}; valid backends are auto, torch, triton")
    if backend == "torch":
        return False
    ok = (q.is_cuda or backend == "triton") and triton_available()
    ok = ok and (state is None or (state.dtype == torch.float32 and _slots_contiguous(state)))
    ok = ok and not (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in grad_inputs))
    if backend == "triton" and not ok:
        raise ValueError("decode backend 'triton' needs triton, an fp32 state with contiguous slots and no autograd")
    return ok


@eager_op
def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, use_qk_l2norm_in_kernel=False, backend="auto"):
    """Token-recurrent KDA for decode and short prefills (fla's `fused_recurrent_kda` contract).

    backend "auto" runs the Triton decode kernel on CUDA without autograd, else the PyTorch loop
    (`decode.fused_recurrent_kda`, differentiable). Returns (o [B, T, H, V], final state or None).
    """
    if not _use_triton_decode(backend, q, initial_state, q, k, v, g, beta, initial_state):
        return _fused_recurrent_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                      use_qk_l2norm_in_kernel)
    from .triton import kda_decode_triton
    N = check_inputs("fused_recurrent_kda", q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        state = torch.zeros(N, H, K, V, device=q.device, dtype=torch.float32)
    else:
        state = initial_state.clone()
    cu = cu_seqlens if cu_seqlens is not None else torch.arange(0, B * T + 1, T, device=q.device)
    flat = [x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o = kda_decode_triton(*flat, state, cu_seqlens=cu, scale=scale,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o.reshape(B, T, H, V), (state if output_final_state else None)


@eager_op
def kda_decode_step(q, k, v, g, beta, state, scale=None, use_qk_l2norm_in_kernel=False,
                    state_indices=None, inplace=True, backend="auto"):
    """Advance N sequences by ONE token each (see `decode.kda_decode_step` for the contract).

    backend "auto" runs the Triton decode kernel on CUDA (fp32 contiguous state, no autograd):
    the indexed pool slots are updated in place and every other slot is left untouched.
    """
    if not _use_triton_decode(backend, q, state, q, k, v, g, beta) or q.dim() != 3:
        return _decode_step_torch(q, k, v, g, beta, state, scale, use_qk_l2norm_in_kernel, state_indices, inplace)
    from .triton import kda_decode_triton
    N, H, K = q.shape
    if state_indices is None and tuple(state.shape) != (N, H, K, v.shape[-1]):
        raise ValueError(f"kda_decode_step: state must have shape [N,H,K,V]={(N, H, K, v.shape[-1])} "
                         f"but got {tuple(state.shape)}")
    if not inplace:
        state = state.clone()
    o = kda_decode_triton(q, k, v, g, beta, state, state_indices=state_indices, scale=scale,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o, state


def _steps_with_states(q, k, v, g, beta, state, slots, cu_seqlens, states_at, scale, l2, o):
    """The PyTorch token steps of `kda_decode_step_gated` with `states_at`: each sequence in pieces cut at its
    requested positions (host loop; the oracle and CPU path). Returns (o, states [M, H, K, V] fp32)."""
    cu, want = [int(x) for x in cu_seqlens.tolist()], [int(x) for x in states_at.tolist()]
    out = state.new_zeros(len(want), *state.shape[1:])
    for i, slot in enumerate(slots.tolist()):
        cuts = sorted({p for p in want if cu[i] < p < cu[i + 1]} | {cu[i + 1]})
        s, a = state[slot][None], cu[i]
        for b in cuts:
            if b > a:
                oi, s = _fused_recurrent_torch(*(x[None, a:b] for x in (q, k, v, g, beta)), scale, s, True,
                                               use_qk_l2norm_in_kernel=l2)
                o[a:b] = oi[0]
            for m, p in enumerate(want):
                if p == b and p > 0:
                    out[m] = s[0].to(out.dtype)
            a = b
        state[slot] = s[0].to(state.dtype)
    return o, out


@eager_op
def kda_decode_step_gated(q, k, v, f, beta_logit, A_log, dt_bias, state, state_indices, lower_bound,
                          scale=None, use_qk_l2norm_in_kernel=True, backend="auto", cu_seqlens=None, chunks=None,
                          states_at=None, state_slots=None):
    """New tokens of n sequences from the raw gate pre-activation: the engine's decode and extend steps.

    q, k, f [N, H, K]; v [N, H, V]; beta_logit [N, H]; A_log [H]; dt_bias [H·K]; state: fp32 pool [P, H, K, V]
    (a layer's strided view of the engine's page-major pool is fine; each slot must be contiguous), updated IN
    PLACE at `state_indices` [n] (distinct). cu_seqlens (int [n + 1], optional): sequence i owns tokens
    cu[i]..cu[i+1] (empty allowed; rows past cu[n] belong to none and get o = 0), stepped through in order;
    without it each sequence has one token (n = N). g = kda_gate(f) and beta = sigmoid(beta_logit), as in
    `chunk_kda_gated`. backend "auto": the Triton decode kernel with the gate and beta fused (CUDA, no
    autograd), else (and for "torch" / "reference") `kda_gate` + the PyTorch step (a host loop over the
    sequences with cu_seqlens). Returns o [N, H, V].
    chunks: optional (tiles [NC, 2], first tile [n]) of the sequences' 16-token tiles, built on the device
    (`paged_cache.token_runs(..., first=True)`): on the Triton path, sequences of `EXTEND_CHUNKED_MIN_TOKENS`
    tokens or more on average then go through the chunked kernels (`kda_extend_triton`) rather than token by token.
    states_at (with cu_seqlens; long [M] on the device, < 1 for an unused entry): packed token positions, each a
    multiple of `STATES_AT_MULTIPLE` tokens into its sequence (or its end), whose states are returned too:
    (o, states [M, H, K, V] fp32, zero for unused entries) — the prefix cache's checkpoints inside a prefill chunk
    (on the Triton path this takes the chunked kernels, which need `chunks`). state_slots: their chunk table
    (`chunk_slots(states_at, cu_seqlens, chunks[1], NC)`) when a caller builds it once for all layers.
    """
    if states_at is not None and (cu_seqlens is None or states_at.dim() != 1):
        raise ValueError(f"kda_decode_step_gated: states_at needs cu_seqlens and one dimension, got "
                         f"{None if states_at is None else tuple(states_at.shape)} with cu_seqlens "
                         f"{'missing' if cu_seqlens is None else 'given'}")
    if not _use_triton_decode("torch" if backend in ("torch", "reference") else backend, q, state,
                              q, k, v, f, beta_logit):
        g = kda_gate(f[None], A_log, dt_bias, lower_bound)[0]
        beta = torch.sigmoid(beta_logit.float())
        if cu_seqlens is None:
            o, _ = _decode_step_torch(q, k, v, g, beta, state, scale, use_qk_l2norm_in_kernel, state_indices,
                                      inplace=True)
            return o
        m = int(cu_seqlens[-1])  # rows past it belong to no sequence: o = 0
        o = torch.zeros_like(v)
        if states_at is not None:
            return _steps_with_states(q, k, v, g, beta, state, state_indices, cu_seqlens, states_at, scale,
                                      use_qk_l2norm_in_kernel, o)
        om, s = _fused_recurrent_torch(*(x[None, :m] for x in (q, k, v, g, beta)), scale, state[state_indices], True,
                                       cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        o[:m], state[state_indices] = om[0], s.to(state.dtype)  # empty sequences: their state, unchanged
        return o
    if chunks is not None and cu_seqlens is not None and (states_at is not None
                                                          or extend_in_chunks(q.shape[0], cu_seqlens.numel() - 1)):
        from .triton import kda_extend_triton
        return kda_extend_triton(q, k, v, f, beta_logit, A_log, dt_bias, state, state_indices, cu_seqlens, *chunks,
                                 scale=scale, lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                 states_at=states_at, state_slots=state_slots)
    if states_at is not None:
        raise ValueError("kda_decode_step_gated: states_at on the Triton path needs the chunk tables (`chunks`)")
    from .triton import kda_decode_triton
    return kda_decode_triton(q, k, v, f, beta_logit, state, state_indices=state_indices, cu_seqlens=cu_seqlens,
                             scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=A_log,
                             dt_bias=dt_bias, lower_bound=lower_bound, beta_logits=True)
