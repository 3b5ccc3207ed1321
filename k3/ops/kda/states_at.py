"""`states_at` for the backends whose kernels cannot emit mid-sequence states (torch, reference, fla).

The serving engine stores KDA states at prefix-cache positions inside a prefill chunk. The Triton kernels
write them out of the chunk loop directly; here each sequence instead runs piece by piece between its
requested positions, the state handed from one piece to the next, so the state at a position is the final
state of the piece that ends there. Same positions rule and outputs as the Triton path: each position is a
multiple of `STATES_AT_MULTIPLE` tokens into its sequence, or the sequence's end.
"""
from __future__ import annotations

import torch

STATES_AT_MULTIPLE = 16  # the Triton kernels' chunk: states exist at chunk ends only


def chunk_slots(states_at: torch.Tensor, cu: torch.Tensor, chunk_off: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """ON THE DEVICE (no host read: a captured graph builds it): the chunk → checkpoint index table int32
    [num_chunks + 1] of the Triton recurrence for packed token positions `states_at` [M], each a multiple of
    `STATES_AT_MULTIPLE` tokens into its sequence (or its end), < 1 for an unused entry (mapped to the spare entry
    num_chunks). cu [n + 1]: the sequences' bounds; chunk_off [n]: each sequence's first chunk."""
    p = states_at.long()
    seq = torch.searchsorted(cu[1:].long(), (p - 1).clamp_min(0), right=True).clamp_max(chunk_off.numel() - 1)
    c = torch.where(p > 0, chunk_off.long()[seq] + (p - 1 - cu.long()[seq]) // STATES_AT_MULTIPLE, num_chunks)
    slot = torch.full((num_chunks + 1,), -1, dtype=torch.int32, device=p.device)
    slot[c] = torch.arange(p.numel(), dtype=torch.int32, device=p.device)
    return slot


def positions(states_at, cu: list[int]) -> list[int]:
    """The requested packed positions as ints, checked against the sequences' bounds `cu` (host ints)."""
    pos = [int(p) for p in torch.as_tensor(states_at).reshape(-1).tolist()]
    seen = set()
    for p in pos:
        n = next((i for i in range(len(cu) - 1) if cu[i] < p <= cu[i + 1]), None)
        if n is None or ((p - cu[n]) % STATES_AT_MULTIPLE and p != cu[n + 1]):
            raise ValueError(f"states_at: position {p} is not a multiple of {STATES_AT_MULTIPLE} tokens into its "
                             f"sequence (nor a sequence end); sequence bounds {cu[:8]}...")
        if p in seen:
            raise ValueError(f"states_at: position {p} requested twice")
        seen.add(p)
    return pos


def chunk_by_pieces(run, q, k, v, g, beta, states_at, initial_state=None, output_final_state=False,
                    cu_seqlens=None, **kw):
    """(o, final state or None, states [M, H, K, V] fp32 at `states_at`) from `run` (a chunk op with the fla
    contract and no `states_at`), calling it once per piece of each sequence between requested positions."""
    B, T, H = q.shape[0], q.shape[1], q.shape[2]
    if B != 1:
        raise ValueError(f"states_at needs one packed row (B == 1), got B={B}")
    cu = [int(x) for x in cu_seqlens.tolist()] if cu_seqlens is not None else [0, T]
    pos = positions(states_at, cu)
    where = {p: m for m, p in enumerate(pos)}
    Kd, Vd = k.shape[-1], v.shape[-1]
    zero = q.new_zeros(1, H, Kd, Vd, dtype=torch.float32)
    outs, finals, sel = [], [], [None] * len(pos)
    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        h = initial_state[n:n + 1] if initial_state is not None else None
        bounds = [bos] + sorted(p for p in pos if bos < p < eos) + [eos]
        for a, b in zip(bounds, bounds[1:]):
            if b == a:
                continue
            o, h = run(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h,
                       output_final_state=True, **kw)
            outs.append(o)
            if b in where:
                sel[where[b]] = h[0]
        h = zero if h is None else h
        finals.append(h)
    o = torch.cat(outs, dim=1) if outs else v.new_empty(1, 0, H, Vd)
    states = torch.stack(sel) if sel else zero[:0]
    return o, (torch.cat(finals) if output_final_state else None), states
