"""Pipeline parallelism for K3 with `torch.distributed.pipelining`, carrying the AttnRes state between stages.

    dims = ParallelDims(pp=2, dp_shard=2)
    mesh = build_mesh(dims, "cuda", model.config.text_config)
    pp_rank = mesh.pp.get_local_rank()
    stage = split_stage(model, pp_rank, dims.pp)          # then drop `model`: other stages' layers are freed
    if dims.ep > 1:
        enable_expert_parallel(stage, mesh.ep.get_group())
    if dims.cp > 1:
        enable_context_parallel(stage, mesh.cp.get_group())  # k3.parallel.cp
    apply_fsdp(stage, mesh)                                # FSDP2 over mesh.fsdp, as for a whole model
    step = PipelineStep(stage, mesh.pp.get_group(), n_microbatches=4, mtp_weight=0.1)
    opt = torch.optim.AdamW(stage.parameters())
    loss = step(input_ids, labels, cu_seqlens)             # [B, T] per data-parallel rank, B % 4 == 0; fwd + bwd
    clip_grad_norm_(stage, 1.0, mesh.pp.get_group(), mesh.ep.get_group())  # global norm, every stage and shard
    opt.step(); opt.zero_grad()

Data parallelism is FSDP2 (`apply_fsdp` on the stage module: `PipelineStage` defers the gradient reduce-scatter
to the last micro-batch), tested on CPU gloo with pp × dp_shard, pp × ep (MoonEP) and pp × cp. Under context
parallelism every cp rank of a stage passes the same whole batch; the step cuts each micro-batch with
`k3.parallel.cp.shard_batch` and returns this rank's share of the loss (the cp ranks' shares add up).

Stage split: stage s holds decoder layers `stage_layers(L, pp)[s]`; stage 0 also the embedding (and the vision
tower, unused by the text step, so that the stages' state dicts add up to the whole model); the last stage the
output AttnRes site, `model.norm`, `lm_head` and the MTP layers. Parameter names are the checkpoint's
(`language_model.model.layers.{i}.…`), so a stage's state_dict keys are a subset of the full model's.

What crosses a boundary: the AttnRes state after the stage's last layer, i.e. the finished block
representations (the embedding first) and the current partial block sum, stacked into one tensor
[n_blocks + 1, b, T, D] (there is no other residual stream: every layer reads its input from this state). The
MTP layers need the embeddings of future tokens: they are the state's first block, so the last stage reads
them from there and their gradient flows back to stage 0's embedding through the pipeline's own backward (no
second copy of the embedding weight, nothing to sum). Under autocast the MTP layers then see the embeddings in
the stream dtype (the single-process model feeds them the uncast embeddings); in fp32 the two are identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..model.decoder import attn_res_output, run_decoder_layers, stream_embeddings
from ..model.k3 import KimiLinearForCausalLM, lm_loss, mtp_losses, target_loss
from ..ops.linear_ce import autocast_cast
from ..ops.varlen import check_cu_seqlens, doc_ids, row_aligned
from .mesh import stage_layers

SCHEDULES = ("1f1b", "gpipe")


def state_size(num_layers_before: int, block_size: int) -> int:
    """Number of [b, T, D] tensors in the AttnRes state after the first `num_layers_before` (≥ 1) decoder layers:
    the finished blocks (the embedding, then one per block boundary at layers block_size, 2·block_size, … that
    has been passed) plus the partial sum."""
    return 2 + (num_layers_before - 1) // block_size


def cu_seqlens_from_docs(docs: torch.Tensor) -> torch.Tensor:
    """[b, T] document ids (equal ids = same document, every row a new one) → int32 cu_seqlens over the b·T
    tokens: a micro-batch's rows of a packed batch, re-based (empty documents disappear; they hold no token)."""
    b, T = docs.shape
    flat = docs.reshape(-1)
    start = torch.ones_like(flat, dtype=torch.bool)
    start[1:] = flat[1:] != flat[:-1]
    start[::T] = True
    idx = start.nonzero().squeeze(1)
    return torch.cat([idx, idx.new_tensor([b * T])]).to(torch.int32)


class StageModule(nn.Module):
    """One pipeline stage of a `K3ForConditionalGeneration` (see the module docstring); built by `split_stage`.

    forward(x, labels=None, docs=None, targets=None, num_targets=None): x is input_ids [b, T] on stage 0, else
    the received state [n, b, T, D]; `docs` [b, T] document ids of packed rows (optional, every stage);
    `labels` [b, T] (HF convention, last stage). Returns the state to send, or on the last stage the loss
    lm_loss + mtp_weight · mtp_loss (its detached parts are appended to `self.loss_parts`).
    Under context parallelism (`k3.parallel.cp.enable_context_parallel(stage, group)`), x holds this rank's
    2s tokens of each row, `docs` the whole rows [b, cp·2s], and the last stage takes `targets`
    [b, 1 + M, 2s] / `num_targets` [1, 1 + M] (`shard_batch`'s, batch first) instead of labels: its loss is
    this rank's share (the cp ranks' losses add up to the micro-batch's)."""

    def __init__(self, model: nn.Module, pp_rank: int, pp_size: int, mtp_weight: float = 0.0):
        super().__init__()
        lm = getattr(model, "language_model", None)
        if not isinstance(lm, KimiLinearForCausalLM):
            raise TypeError(f"split_stage needs a K3ForConditionalGeneration, got {type(model).__name__}")
        if not (isinstance(pp_size, int) and pp_size >= 1 and isinstance(pp_rank, int) and 0 <= pp_rank < pp_size):
            raise ValueError(f"pp_rank={pp_rank!r} must be an integer in [0, pp_size={pp_size!r})")
        cfg, m = lm.config, lm.model
        L = cfg.num_hidden_layers
        self.layer_ids = stage_layers(L, pp_size)[pp_rank]
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        self.block_size, self.hidden_size = cfg.attn_res_block_size, cfg.hidden_size
        self.mtp_weight = float(mtp_weight)
        self.loss_impl, self.gradient_checkpointing = lm.loss_impl, m.gradient_checkpointing
        self.autocast_stream, self.attn_res_backend = m.autocast_stream, m.attn_res_backend
        self.loss_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_mtp = len(m.layers) - L
        self.state_dtype: torch.dtype | None = None  # what PipelineStep sends between stages (checked)

        # the checkpoint's module tree, holding only this stage's modules
        self.language_model = nn.Module()
        self.language_model.context_parallel = None  # set by k3.parallel.cp.enable_context_parallel(stage, …)
        self.language_model.model = inner = nn.Module()
        ids = list(self.layer_ids) + (list(range(L, len(m.layers))) if self.is_last else [])
        inner.layers = nn.ModuleDict({str(i): m.layers[i] for i in ids})
        if self.is_first:
            inner.embed_tokens = m.embed_tokens
            for name in ("vision_tower", "mm_projector"):
                if getattr(model, name, None) is not None:
                    setattr(self, name, getattr(model, name))
        if self.is_last:
            inner.norm, inner.output_attn_res_norm = m.norm, m.output_attn_res_norm
            inner.output_attn_res_proj = m.output_attn_res_proj
            self.language_model.lm_head = lm.lm_head
        self.train(model.training)

    @property
    def decoder_layers(self) -> list[nn.Module]:
        return [self.language_model.model.layers[str(i)] for i in self.layer_ids]

    @property
    def mtp_layers(self) -> list[nn.Module]:
        if not self.is_last:
            return []
        lo = self.layer_ids.stop
        return [layer for k, layer in self.language_model.model.layers.items() if int(k) >= lo]

    def input_state_size(self) -> int:
        """Tensors in the received state (stage > 0)."""
        return state_size(self.layer_ids.start, self.block_size)

    def output_state_size(self) -> int:
        """Tensors in the sent state (stage < last)."""
        return state_size(self.layer_ids.stop, self.block_size)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, docs: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, num_targets: torch.Tensor | None = None) -> torch.Tensor:
        inner = self.language_model.model
        cu = None if docs is None else cu_seqlens_from_docs(docs)
        if self.is_first:
            embeds = inner.embed_tokens(x)
            blocks, partial = [stream_embeddings(embeds, self.autocast_stream)], None
        else:
            if x.dim() != 4 or x.shape[0] != self.input_state_size():
                raise ValueError(f"stage {self.pp_rank} expects the AttnRes state [{self.input_state_size()}, b, T, "
                                 f"{self.hidden_size}], got {tuple(x.shape)}")
            *blocks, partial = x.unbind(0)
        blocks, partial = run_decoder_layers(self.decoder_layers, list(blocks), partial, self.block_size,
                                             cu_seqlens=cu, checkpoint=self.gradient_checkpointing and self.training)
        if not self.is_last:
            out = torch.stack(blocks + [partial])
            if self.state_dtype is not None and out.dtype != self.state_dtype:
                raise ValueError(f"stage {self.pp_rank} produced its AttnRes state in {out.dtype}, but the pipeline "
                                 f"sends {self.state_dtype}: pass PipelineStep(state_dtype={out.dtype})")
            return out
        cp = self.language_model.context_parallel
        if (labels is None or targets is not None) if cp is None else (targets is None or labels is not None):
            raise ValueError("the last pipeline stage needs labels, or targets / num_targets under context "
                             "parallelism (not both)")
        return self._loss(blocks, partial, labels, cu, docs, targets, num_targets)

    def _loss(self, blocks, partial, labels, cu, docs, targets=None, num_targets=None) -> torch.Tensor:
        """The head part of `KimiLinearForCausalLM.forward` in training: LM loss (+ mtp_weight · MTP loss)."""
        inner, head = self.language_model.model, self.language_model.lm_head
        h = attn_res_output(blocks, partial, inner.output_attn_res_norm, inner.output_attn_res_proj,
                            self.attn_res_backend)
        hn = inner.norm(h)
        head_w = autocast_cast(head.weight) if self.training and self.loss_impl == "fused" else None
        mtp = None
        if targets is not None:  # context parallel: this rank's share of the micro-batch's losses
            cp, (tg, nt) = self.language_model.context_parallel, (targets.transpose(0, 1), num_targets[0])
            loss = target_loss(hn, None if head_w is not None else head(hn), head_w, tg[0], nt[0])
            if tg.shape[0] > 1:
                _, mtp = mtp_losses(self.mtp_layers, head, blocks[0], h, None, None, cu, None, head_w, tg, nt,
                                    cp.shift_tokens)
        else:
            b, T = labels.shape
            dids = None if docs is None else doc_ids(cu, b, T)
            loss = (lm_loss(head(hn), labels, docs=dids) if head_w is None
                    else KimiLinearForCausalLM._fused_loss(hn, head_w, labels, 1, dids))
            if self.mtp_layers and T > 2:
                _, mtp = mtp_losses(self.mtp_layers, head, blocks[0], h, None, labels, cu, dids, head_w)
        if mtp is None:
            mtp = torch.zeros((), device=loss.device, dtype=loss.dtype)
        self.loss_parts.append((loss.detach(), mtp.detach()))
        return loss + self.mtp_weight * mtp if self.mtp_weight else loss


def split_stage(model: nn.Module, pp_rank: int, pp_size: int, mtp_weight: float = 0.0) -> StageModule:
    """The stage module of pipeline rank `pp_rank` of `pp_size`, sharing (not copying) the kept modules of
    `model` (a `K3ForConditionalGeneration`, before `enable_expert_parallel` / `apply_fsdp`, which are applied
    to the stage). `mtp_weight` weights the MTP loss in the last stage's loss (PipelineStep sets it)."""
    return StageModule(model, pp_rank, pp_size, mtp_weight)


class PipelineStep:
    """One training step's forward + backward over `n_microbatches` with a `torch.distributed.pipelining`
    schedule ("1f1b": `Schedule1F1B`, needs n_microbatches ≥ pp; "gpipe": `ScheduleGPipe`).

    step(input_ids, labels, cu_seqlens=None) → the step's loss: mean over the micro-batches of
    lm_loss + mtp_weight · mtp_loss, the same value on every rank of `pp_group` (broadcast from the last stage);
    `self.lm_loss` / `self.mtp_loss` hold its two parts. Every pp rank passes the same batch (stage 0 uses
    input_ids, the last stage labels, every stage cu_seqlens). The micro-batches are B / n_microbatches
    consecutive rows; with `cu_seqlens` every row must start a document (the packing convention). Under context
    parallelism the returned loss and its parts are this cp rank's shares (sum them over the cp group).
    Gradients of d(loss)/dθ are *accumulated* into the stage's parameters (call zero_grad between steps);
    under FSDP2 they are reduced over the data-parallel ranks as in `apply_fsdp` (mean over dp_shard·ep).
    `forward_loss(input_ids, labels, cu_seqlens=None)`: the batch's forward only (evaluation), stages in turn.
    `state_dtype`: dtype of the AttnRes state sent between stages (default: the dtype of the stage's first
    floating parameter; pass the autocast dtype under autocast, or the param_dtype of FSDP mixed precision).
    """

    def __init__(self, stage: StageModule, pp_group, n_microbatches: int, mtp_weight: float = 0.0,
                 schedule: str = "1f1b", state_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        if not isinstance(stage, StageModule):
            raise TypeError(f"PipelineStep needs a StageModule from split_stage, got {type(stage).__name__}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        pp = dist.get_world_size(pp_group)
        if pp != stage.pp_size or dist.get_rank(pp_group) != stage.pp_rank:
            raise ValueError(f"the stage was split for pp rank {stage.pp_rank} of {stage.pp_size}, but this process "
                             f"is rank {dist.get_rank(pp_group)} of the pp group's {pp}")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches={n_microbatches!r} must be an integer >= 1")
        if schedule == "1f1b" and n_microbatches < pp:
            raise ValueError(f"schedule '1f1b' needs n_microbatches >= pp, got {n_microbatches} < {pp}")
        params = [p for p in stage.parameters() if p.is_floating_point()]
        self.stage, self.group, self.n, self.kind = stage, pp_group, n_microbatches, schedule
        self.state_dtype = state_dtype or params[0].dtype
        self.device = torch.device(device) if device is not None else params[0].device
        self.lm_loss = self.mtp_loss = None
        stage.mtp_weight, stage.state_dtype = float(mtp_weight), self.state_dtype
        self._built: tuple | None = None  # ((b, T), schedule)

    def _schedule(self, b: int, T: int):
        """The PipelineStage + schedule for micro-batches [b, T], with static shapes (no inference pass)."""
        if self._built is not None and self._built[0] == (b, T):
            return self._built[1]
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        s, D = self.stage, self.stage.hidden_size
        meta = dict(device="meta", dtype=self.state_dtype)
        inp = (torch.empty(b, T, dtype=torch.long, device="meta") if s.is_first else
               torch.empty(s.input_state_size(), b, T, D, **meta).requires_grad_())
        loss_dtype = torch.promote_types(self.state_dtype, torch.float32)
        out = (torch.empty((), device="meta", dtype=loss_dtype) if s.is_last else
               torch.empty(s.output_state_size(), b, T, D, **meta).requires_grad_())
        ps = PipelineStage(s, s.pp_rank, s.pp_size, self.device, input_args=inp, output_args=out, group=self.group)
        cls = Schedule1F1B if self.kind == "1f1b" else ScheduleGPipe
        n = self.n
        sched = cls(ps, n, loss_fn=lambda out, target: out / n, scale_grads=False)
        self._built = ((b, T), sched)
        return sched

    def _inputs(self, input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor | None, n: int):
        """Check a batch and cut it for `n` micro-batches: (this rank's input_ids, the schedule's target, the
        stage's keyword arguments: docs on every stage; labels, or targets / num_targets under cp, on the last)."""
        if input_ids.dim() != 2 or labels.shape != input_ids.shape:
            raise ValueError(f"input_ids and labels must both be [B, T], got {tuple(input_ids.shape)} and "
                             f"{tuple(labels.shape)}")
        B, T = input_ids.shape
        if B % n:
            raise ValueError(f"batch rows B={B} must be divisible by n_microbatches={n}")
        s, kw = self.stage, {}
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, B * T)
            if not row_aligned(cu_seqlens, B, T):
                raise ValueError(f"cu_seqlens {cu_seqlens.tolist()} must have a document boundary at every row "
                                 f"start (multiples of T={T}): micro-batches are whole rows")
            kw["docs"] = doc_ids(cu_seqlens.to(input_ids.device), B, T)
        cp = s.language_model.context_parallel
        if cp is not None:
            input_ids, target, extra = self._shard_cp(cp, input_ids, labels, kw.get("docs"), n)
            if s.is_last:
                kw.update(extra)
        else:
            target = labels
            if s.is_last:
                kw["labels"] = labels
        return input_ids, target, kw

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor,
                 cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        s = self.stage
        input_ids, target, kw = self._inputs(input_ids, labels, cu_seqlens, self.n)
        sched = self._schedule(input_ids.shape[0] // self.n, input_ids.shape[1])
        s.loss_parts.clear()
        losses: list[torch.Tensor] = []
        args = (input_ids,) if s.is_first else ()
        sched.step(*args, target=target if s.is_last else None, losses=losses if s.is_last else None,
                   return_outputs=False, **kw)
        parts = torch.zeros(3, dtype=torch.float32, device=self.device)
        if s.is_last:
            lm = torch.stack([p[0] for p in s.loss_parts]).float().mean()
            mtp = torch.stack([p[1] for p in s.loss_parts]).float().mean()
            parts = torch.stack([torch.stack(losses).float().sum(), lm, mtp]).to(self.device)
        s.loss_parts.clear()
        dist.broadcast(parts, group_src=s.pp_size - 1, group=self.group)
        loss, self.lm_loss, self.mtp_loss = parts.unbind(0)
        return loss

    @torch.no_grad()
    def forward_loss(self, input_ids: torch.Tensor, labels: torch.Tensor,
                     cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only (evaluation; no schedule, no gradients): the whole batch as one micro-batch, the stages
        in turn — stage s receives the AttnRes state from s − 1 and sends its own to s + 1. Returns (lm_loss,
        mtp_loss) of the batch (fp32, the same on every rank of `pp_group`; under cp this rank's shares), as
        the single-process model's forward on the batch gives (`mtp_loss` 0 without MTP layers)."""
        s = self.stage
        ids, _, kw = self._inputs(input_ids, labels, cu_seqlens, 1)
        if s.is_first:
            x = ids
        else:
            x = torch.empty(s.input_state_size(), ids.shape[0], ids.shape[1], s.hidden_size,
                            dtype=self.state_dtype, device=self.device)
            dist.recv(x, group_src=s.pp_rank - 1, group=self.group)
        s.loss_parts.clear()
        out = s(x, **kw)
        parts = torch.zeros(2, dtype=torch.float32, device=self.device)
        if s.is_last:
            parts = torch.stack(s.loss_parts[-1]).float().to(self.device)
        else:
            dist.send(out.contiguous(), group_dst=s.pp_rank + 1, group=self.group)
        s.loss_parts.clear()
        dist.broadcast(parts, group_src=s.pp_size - 1, group=self.group)
        lm, mtp = parts.unbind(0)
        return lm, mtp

    def _shard_cp(self, cp, input_ids, labels, docs, n: int):
        """Context parallel: `shard_batch` per micro-batch, n of them (each micro-batch's targets and its own
        target counts, as the single-process step's per-micro-batch mean); returns this rank's input_ids [B, 2s], the
        schedule's target and the last stage's kwargs (targets [B, 1 + M, 2s], num_targets [n, 1 + M])."""
        from .cp import shard_batch

        rows = input_ids.shape[0] // n
        ids, tgs, nts = [], [], []
        for i in range(n):
            sl = slice(i * rows, (i + 1) * rows)
            mb = {"input_ids": input_ids[sl], "labels": labels[sl]}
            if docs is not None:
                mb["cu_seqlens"] = cu_seqlens_from_docs(docs[sl])
            sh = shard_batch(mb, cp.rank, cp.size, self.stage.num_mtp)
            ids.append(sh["input_ids"])
            tgs.append(sh["targets"].transpose(0, 1))
            nts.append(sh["num_targets"])
        targets = torch.cat(tgs)
        return torch.cat(ids), targets, {"targets": targets, "num_targets": torch.stack(nts)}


def ep_sliced(module: nn.Module) -> set[str]:
    """Names of the routed-expert parameters that hold only this rank's E/ep home experts (MoonEP with ep > 1)."""
    from ..model.moe import LatentMoE

    out = set()
    for name, m in module.named_modules():
        if isinstance(m, LatentMoE) and m.experts.w1.shape[0] < m.cfg.num_experts:
            out |= {f"{name}.experts.{k}" if name else f"experts.{k}" for k in ("w1", "w2", "w3")}
    return out


@torch.no_grad()
def clip_grad_norm_(stage: nn.Module, max_norm: float, pp_group, ep_group=None) -> torch.Tensor:
    """Clip the gradients of every stage to a global norm ≤ max_norm; returns the total norm (fp32, the same on
    every rank). Each gradient element of the whole model is counted once:
    - FSDP2 gradients (DTensors with Shard placements): local shards summed over their mesh;
    - gradients of EP-sliced experts (`ep_sliced`, plain or FSDP-sharded): then also summed over `ep_group`
      (required when the stage runs MoonEP with ep > 1);
    - other plain gradients: replicated over the stage's data-parallel ranks (after the caller's gradient
      all-reduce, e.g. `moonep.sync_data_parallel_grads`), counted once;
    then the stages' squared norms are summed over `pp_group`. Collective over the whole mesh."""
    from torch.distributed.tensor import DTensor

    sliced = ep_sliced(stage)
    if sliced and ep_group is None:
        raise ValueError(f"the stage's experts are EP-sliced ({sorted(sliced)[0]}, …): pass ep_group")
    grads = [(n, p.grad) for n, p in stage.named_parameters() if p.grad is not None]
    dev = grads[0][1].device if grads else torch.device("cpu")
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    sums = {False: zero.clone(), True: zero.clone()}  # EP-sliced or not → squared sum
    by_mesh: dict[tuple, list] = {}  # (id(mesh), sliced) → [mesh, squared sum of the local shards]
    for n, g in grads:
        ep = n in sliced
        if isinstance(g, DTensor):
            if all(pl.is_shard() for pl in g.placements):
                slot = by_mesh.setdefault((id(g.device_mesh), ep), [g.device_mesh, zero.clone()])
                slot[1] += g.to_local().double().square().sum()
            else:  # a replicated / partial placement: let DTensor reduce this one
                sums[ep] += g.full_tensor().double().square().sum()
        else:
            sums[ep] += g.double().square().sum()
    for (_, ep), (mesh, sq) in by_mesh.items():
        for d in range(mesh.ndim):
            dist.all_reduce(sq, group=mesh.get_group(d))
        sums[ep] += sq
    if ep_group is not None:
        dist.all_reduce(sums[True], group=ep_group)
    total = sums[False] + sums[True]
    dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for _, g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
    return norm.float()
