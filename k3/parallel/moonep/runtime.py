"""MoonEP runtime, reference backend on plain torch.distributed collectives (gloo on CPU, NCCL on GPU).

Every collective has the same shape on every step, whatever the routing:

- plan: all-gather the per-expert counts [R, E] and every rank's slot addresses [R, S·K] (int64);
- dispatch: one hidden row per (token, destination rank) — the static-size buffer holds every token, i.e. an
  all-gather of [S, H] — then the rows are expanded into their expert-grouped slots ([NvS, H]; a token's
  duplicate entries on one rank read the same row, pad rows are zero); route weights [S·K] likewise;
- prefetch: owners push the planned experts' weights into the destinations' slot pools (an all-to-all of
  [R, E/R, …]: chunk (d, b) is expert experts_to_copy[d, b] from its owner, zero elsewhere). Optional
  `prefetch="sparse"` moves only the planned experts (all_to_all_single with splits from the [R, E/R]
  table, copied to the host once per plan: one small device-to-host sync, fewer bytes when few experts move);
- combine: fp32 local reduction of each token's duplicate rows first, then the rows travel back in the
  data dtype (all-to-all [R, S, H]) and are summed over ranks in fp32;
- backward reuses the plan: combine's backward is dispatch, dispatch's is combine, the route-weight
  backward returns [NvS] gradients to their [S, K] entries, and prefetch's backward is reduce_grad (replica
  gradients in an fp32 buffer, summed back to the owner in ascending (source rank, slot) order; the
  consumed buffer slots are zeroed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm
from .planner import MoonEPPlan, plan as make_plan


@dataclass
class RuntimePlan:
    """A MoonEPPlan plus the receiver-side tables this rank needs; reused unchanged by the backward."""
    plan: MoonEPPlan
    slot_entry: torch.Tensor  # [NvS] global entry id src·S·K + s·K + k, or R·S·K for pad/tail rows
    slot_token: torch.Tensor  # [NvS] global token row src·S + s, or R·S for pad/tail rows
    send_row: torch.Tensor    # [R, epn] local expert row this rank pushes into slot (d, b), −1 if none
    slot_owner: torch.Tensor  # [epn] owner rank of this rank's slot b, −1 if idle
    backward_uses: int = field(default=0)
    host: dict | None = field(default=None)  # sparse prefetch: split tables on the host (built once)

    @property
    def nvs(self) -> int:
        return self.plan.nvs


class MoonEPRuntime:
    """Planning and the differentiable dispatch / prefetch / combine ops over one process group."""

    def __init__(self, group=None, padding: int = 1, prefetch: str = "static"):
        if padding < 1:
            raise ValueError(f"padding={padding} must be ≥ 1")
        if prefetch not in ("static", "sparse"):
            raise ValueError(f"prefetch must be 'static' or 'sparse', got {prefetch!r}")
        self.group, self.padding, self.prefetch_mode = group, padding, prefetch
        self.rank, self.R = dist.get_rank(group), dist.get_world_size(group)
        self.num_plans = 0
        self._reduce_buffers: dict[tuple, torch.Tensor] = {}

    # ---- planning -------------------------------------------------------------------------------------
    def plan(self, topk_idx: torch.Tensor, num_experts: int) -> RuntimePlan:
        """topk_idx [S, K] (same S, K on every rank) → RuntimePlan. Collective; no host sync."""
        S, K = topk_idx.shape
        flat = topk_idx.reshape(-1).long()
        tpe = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
        tpe.scatter_add_(0, flat, torch.ones_like(flat))
        tpe_all = comm.all_gather(tpe[None], self.group)  # [R, E]
        p = make_plan(topk_idx, tpe_all, self.rank, self.padding)
        dst_all = comm.all_gather(p.dst, self.group)  # [R·S·K]
        n = dst_all.numel()
        mine = dst_all // p.nvs == self.rank
        slot_entry = torch.full((p.nvs + 1,), n, dtype=torch.long, device=flat.device)
        slot_entry.scatter_(0, torch.where(mine, dst_all % p.nvs, p.nvs), torch.arange(n, device=flat.device))
        slot_entry = slot_entry[:p.nvs]
        slot_token = torch.where(slot_entry < n, slot_entry // K, self.R * S)
        etc, epn = p.experts_to_copy, p.epn
        owner = torch.where(etc >= 0, etc // epn, -1)
        send_row = torch.where(owner == self.rank, etc - self.rank * epn, -1)
        self.num_plans += 1
        return RuntimePlan(p, slot_entry, slot_token, send_row, owner[self.rank])

    # ---- data movement (autograd) ---------------------------------------------------------------------
    def dispatch(self, hidden: torch.Tensor, rp: RuntimePlan) -> torch.Tensor:
        """[S, H] → [NvS, H]: each slot row holds its entry's token row; pad/tail rows are zero."""
        return _Dispatch.apply(hidden, self, rp)

    def dispatch_weights(self, route_weights: torch.Tensor, rp: RuntimePlan) -> torch.Tensor:
        """[S, K] → [NvS] fp32 (per-entry route weight at its slot, 0 on pad rows)."""
        return _DispatchWeights.apply(route_weights, self, rp)

    def combine(self, y: torch.Tensor, rp: RuntimePlan, out_dtype: torch.dtype) -> torch.Tensor:
        """[NvS, H] → [S, H]: unweighted sum over each token's entries (fp32 local, then cross-rank in fp32)."""
        return _Combine.apply(y, self, rp, out_dtype)

    def prefetch(self, rp: RuntimePlan, *local_weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each local [E/R, …] → [2·E/R, …]: the home experts followed by this rank's prefetched slots."""
        return _Prefetch.apply(self, rp, *local_weights)

    # ---- raw (non-autograd) implementations -----------------------------------------------------------
    def _dispatch_raw(self, x: torch.Tensor, rp: RuntimePlan) -> torch.Tensor:
        g = comm.all_gather(x, self.group)
        g = torch.cat([g, g.new_zeros(1, g.shape[1])])  # row R·S: the zero pad row
        return g.index_select(0, rp.slot_token)

    def _combine_raw(self, y: torch.Tensor, rp: RuntimePlan, out_dtype: torch.dtype) -> torch.Tensor:
        S = rp.plan.S
        part = torch.zeros(self.R * S + 1, y.shape[1], dtype=torch.float32, device=y.device)
        part.index_add_(0, rp.slot_token, y.float())  # duplicates of a token summed locally in fp32
        back = comm.all_to_all(part[:-1].to(out_dtype).view(self.R, S, -1), self.group)  # wire: data dtype
        return back.float().sum(0).to(out_dtype)

    def _host_tables(self, rp: RuntimePlan) -> dict:
        """Sparse prefetch splits (once per plan): the local rows this rank sends to each destination and
        the slots it fills from each owner, both in ascending slot order."""
        if rp.host is None:
            etc, epn, me = rp.plan.experts_to_copy.tolist(), rp.plan.epn, self.rank
            send_rows = [[e - me * epn for e in etc[d] if e >= 0 and e // epn == me] for d in range(self.R)]
            recv_slots = [[b for b in range(epn) if etc[me][b] >= 0 and etc[me][b] // epn == o] for o in range(self.R)]
            rp.host = {"send_rows": send_rows, "recv_slots": recv_slots}
        return rp.host

    def _prefetch_sparse(self, w: torch.Tensor, rp: RuntimePlan) -> torch.Tensor:
        t = self._host_tables(rp)
        rows = [r for d in range(self.R) for r in t["send_rows"][d]]
        send = w.index_select(0, torch.tensor(rows, dtype=torch.long, device=w.device)).reshape(len(rows), w[0].numel())
        n_in = [len(v) for v in t["recv_slots"]]
        recv = send.new_empty(sum(n_in), send.shape[1])
        dist.all_to_all_single(recv, send, n_in, [len(v) for v in t["send_rows"]], group=self.group)
        slots = w.new_zeros((rp.plan.epn,) + tuple(w.shape[1:]))
        b = [x for v in t["recv_slots"] for x in v]
        slots[torch.tensor(b, dtype=torch.long, device=w.device)] = recv.view((len(b),) + tuple(w.shape[1:]))
        return slots

    def _reduce_grad_sparse(self, rp: RuntimePlan, buffer: torch.Tensor) -> torch.Tensor:
        t, epn, shape = self._host_tables(rp), rp.plan.epn, tuple(buffer.shape[1:])
        b = [x for v in t["recv_slots"] for x in v]
        send = buffer[torch.tensor(b, dtype=torch.long, device=buffer.device)].reshape(len(b), buffer[0].numel())
        n_back = [len(v) for v in t["send_rows"]]
        recv = send.new_empty(sum(n_back), send.shape[1])
        dist.all_to_all_single(recv, send, n_back, [len(v) for v in t["recv_slots"]], group=self.group)
        rows = torch.tensor([r for d in range(self.R) for r in t["send_rows"][d]], dtype=torch.long,
                            device=buffer.device)
        out = buffer.new_zeros((epn,) + shape).index_add_(0, rows, recv.view((-1,) + shape))
        buffer.mul_((rp.slot_owner < 0).view(-1, *[1] * len(shape)))  # consumed slots → 0
        return out

    def reduce_grad(self, rp: RuntimePlan, buffer: torch.Tensor) -> torch.Tensor:
        """Replica grads `buffer` [E/R, …] fp32 (this rank's slots) → fp32 grads of the home experts.

        Slot b goes to its owner; the owner adds the slots holding its experts in ascending (source rank,
        slot) order onto zero; the consumed slots of `buffer` are zeroed."""
        if self.prefetch_mode == "sparse":
            return self._reduce_grad_sparse(rp, buffer)
        p, epn = rp.plan, rp.plan.epn
        valid = rp.slot_owner >= 0
        send = buffer.new_zeros((self.R,) + tuple(buffer.shape))
        b = torch.arange(epn, device=buffer.device)
        send[rp.slot_owner.clamp_min(0), b] = torch.where(valid.view(-1, *[1] * (buffer.dim() - 1)), buffer, 0)
        recv = comm.all_to_all(send, self.group)  # [R(src), epn, …]
        etc = p.experts_to_copy  # [R, epn]
        ours = (etc >= 0) & (etc // epn == self.rank)
        rows = torch.where(ours, etc - self.rank * epn, epn).reshape(-1)  # row epn: discard
        out = buffer.new_zeros((epn + 1,) + tuple(buffer.shape[1:]))
        out.index_add_(0, rows, recv.reshape((-1,) + tuple(buffer.shape[1:])))
        buffer.mul_(~valid.view(-1, *[1] * (buffer.dim() - 1)))  # consumed slots → 0
        return out[:epn]

    def reduce_buffer(self, shape: tuple, device) -> torch.Tensor:
        """The process-wide fp32 replica-gradient buffer for one weight shape (shared by all layers)."""
        key = (tuple(shape), str(device))
        if key not in self._reduce_buffers:
            self._reduce_buffers[key] = torch.zeros(shape, dtype=torch.float32, device=device)
        return self._reduce_buffers[key]


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, rt, rp):
        ctx.rt, ctx.rp, ctx.dtype = rt, rp, hidden.dtype
        return rt._dispatch_raw(hidden, rp)

    @staticmethod
    def backward(ctx, grad):
        ctx.rp.backward_uses += 1
        return ctx.rt._combine_raw(grad, ctx.rp, ctx.dtype), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rt, rp, out_dtype):
        ctx.rt, ctx.rp, ctx.dtype = rt, rp, y.dtype
        return rt._combine_raw(y, rp, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        ctx.rp.backward_uses += 1
        return ctx.rt._dispatch_raw(grad, ctx.rp).to(ctx.dtype), None, None, None


class _DispatchWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, rt, rp):
        ctx.rt, ctx.rp, ctx.shape, ctx.dtype = rt, rp, w.shape, w.dtype
        g = comm.all_gather(w.reshape(-1).float(), rt.group)
        return torch.cat([g, g.new_zeros(1)]).index_select(0, rp.slot_entry)

    @staticmethod
    def backward(ctx, grad):
        rt, rp = ctx.rt, ctx.rp
        rp.backward_uses += 1
        n = rt.R * rp.plan.S * rp.plan.K
        buf = grad.new_zeros(n + 1, dtype=torch.float32).index_put_((rp.slot_entry,), grad.float())
        back = comm.all_to_all(buf[:-1].view(rt.R, -1), rt.group)  # one non-zero source per entry
        return back.sum(0).view(ctx.shape).to(ctx.dtype), None, None


class _Prefetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rt, rp, *ws):
        ctx.rt, ctx.rp = rt, rp
        ctx.dtypes = [w.dtype for w in ws]
        epn, b = rp.plan.epn, torch.arange(rp.plan.epn, device=ws[0].device)
        out = []
        for w in ws:
            if rt.prefetch_mode == "sparse":
                out.append(torch.cat([w, rt._prefetch_sparse(w, rp)]))
                continue
            ones = [1] * (w.dim() - 1)
            send = w.index_select(0, rp.send_row.clamp_min(0).reshape(-1)).view(rt.R, epn, *w.shape[1:])
            send.masked_fill_((rp.send_row < 0).view(rt.R, epn, *ones), 0)
            recv = comm.all_to_all(send, rt.group)  # [R(owner), epn, …]
            del send
            slots = recv[rp.slot_owner.clamp_min(0), b]
            del recv
            slots.masked_fill_((rp.slot_owner < 0).view(epn, *ones), 0)
            out.append(torch.cat([w, slots]))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        rt, rp = ctx.rt, ctx.rp
        rp.backward_uses += 1
        epn, res = rp.plan.epn, []
        for g, dt in zip(grads, ctx.dtypes):
            buf = rt.reduce_buffer((epn,) + tuple(g.shape[1:]), g.device)
            buf.copy_(g[epn:])  # replica gradients → the fp32 buffer
            res.append((g[:epn].float() + rt.reduce_grad(rp, buf)).to(dt))
        return (None, None, *res)
