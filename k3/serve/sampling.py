"""Batched sampling with per-request temperature / top-k / top-p / seed, and log-probs.

Rows are processed in groups: greedy rows by one argmax; rows without a seed share one multinomial draw;
seeded rows draw from their own `torch.Generator`, so a seeded request's tokens do not depend on what
else is in the batch.

Numerics: the temperature divides `logits - max(logits)`, so the winning logit stays exactly 0 and any
temperature > 0 gives finite or -inf scores, never NaN (rows whose temperature is below fp32's smallest
normal number are scaled in fp64, so 1e-50 behaves as the limit it is: the argmax). A row whose logits hold
NaN / +inf (or are all -inf) cannot be sampled: `sample_rows` reports it and still samples every other row;
`sample` raises `SamplingError` naming the rows before any generator is advanced.
"""

from __future__ import annotations

import torch

from ..ops.sampling import filter_probs, greedy_pick, host_tensor, nonfinite_rows, picked, write_outputs
from .request import SamplingParams


class SamplingError(RuntimeError):
    """Rows of a batch that could not be sampled (non-finite logits). `rows` index the batch; `params` are
    those rows' SamplingParams objects (identity tells their requests apart)."""

    def __init__(self, rows: list[int], params: list[SamplingParams]):
        super().__init__(f"the logits of batch rows {rows} are not finite (NaN / +inf, or all -inf); "
                         "those requests cannot be sampled")
        self.rows, self.params = rows, params


def sample_device(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                  rows: torch.Tensor | None = None, last: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] fp32 → (token ids [n] int64, log p(token) [n] fp32 under log_softmax(logits)), both on
    the logits' device and without reading anything back to the host (the engine's asynchronous scheduling
    feeds the ids to the next forward before the host has seen them). A row whose logits are not finite
    (`nonfinite_rows`) gets token -1 and log-prob NaN; the others are sampled as if it were absent. `rows` /
    `last`: also written (`k3.ops.sampling.write_outputs`; an all-greedy batch in the greedy kernels)."""
    n = logits.shape[0]
    if len(params) != n or len(generators) != n:
        raise ValueError(f"need one SamplingParams and generator per row ({n}), got {len(params)} and "
                         f"{len(generators)}")
    dev = logits.device
    greedy = [i for i, p in enumerate(params) if p.greedy]
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if not rand:  # the common decode batch: argmax and its log-prob in one pass (two kernels on CUDA)
        return greedy_pick(logits, rows=rows, last=last)
    bad = nonfinite_rows(logits)
    out = torch.empty(n, dtype=torch.long, device=dev)
    if greedy:
        gi = host_tensor(greedy, dev)
        out[gi] = logits[gi].argmax(-1)
    ri = host_tensor(rand, dev)
    sub = logits[ri]
    sub = torch.where(bad[ri][:, None], torch.zeros((), device=dev, dtype=sub.dtype), sub)  # failed rows
    probs = filter_probs(sub, [params[i].temperature for i in rand], [params[i].top_k for i in rand],
                         [params[i].top_p for i in rand])
    shared = [j for j, i in enumerate(rand) if generators[i] is None]
    if shared:
        sj = host_tensor(shared, dev)
        out[ri[sj]] = torch.multinomial(probs[sj], 1).squeeze(-1)
    for j, i in enumerate(rand):
        if generators[i] is not None:
            out[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return write_outputs(*picked(logits, out, bad), rows, last)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
                ) -> tuple[list[int], list[float], list[int]]:
    """logits [n, V] fp32 → (token ids, log p(token) under log_softmax(logits), failed rows: token -1), on the
    host: `sample_device`, then one device→host copy (ids < 2^53 are exact in fp64)."""
    toks, lps = sample_device(logits, params, generators)
    host = torch.stack([toks.double(), lps.double()]).tolist()
    ids = [int(t) for t in host[0]]
    return ids, host[1], [i for i, t in enumerate(ids) if t < 0]


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """logits [n, V] fp32 → (token ids, log p(token) under log_softmax(logits)). Raises `SamplingError`
    (before advancing any generator) when a row cannot be sampled."""
    bad = nonfinite_rows(logits)
    if bool(bad.any()):
        rows = bad.nonzero()[:, 0].tolist()
        raise SamplingError(rows, [params[i] for i in rows])
    toks, lps, _ = sample_rows(logits, params, generators)
    return toks, lps
