"""The pre-training loop behind `k3 train` (K3_SPEC §7).

Per step: `grad_accum` micro-batches of packed documents (KDA state, short convs, MLA attention and the
losses never cross a document boundary), LM loss + `mtp_weight` × MTP loss, gradient clipping, Per-Head
Muon + AdamW, the cosine schedule, QK-clip on the MLA heads, the router's selection bias updated by
Quantile Balancing. The context-length curriculum changes the row length at stage boundaries while
keeping the tokens per step. bf16 autocast on GPU, fp32 on CPU.

Resume is exact: a checkpoint holds the weights, optimizer, schedule, QK-clip and balancing state, the
data position and every RNG, so stopping at step N and resuming reproduces an uninterrupted run (bitwise on
CPU). A non-finite loss stops the run, naming the step, and keeps the last good checkpoint.

One host read per step (on a GPU, the only point where the host waits for it): the losses and gradient norm
before the optimizer, with the previous step's QK-clip / balancing statistics, whose log row is written then (or
before a checkpoint, an evaluation, a sample or the end). Batches carry `cu_seqlens` with its host values
(`k3.ops.varlen.bounds_to`), so the forward reads nothing back.

Under torchrun the run has a layout (`--dp-shard/--ep/--cp/--pp`, `TrainConfig.layout`) and a `DeviceMesh`
(`k3.parallel.mesh`): MoonEP over `ep`, then FSDP2 over `fsdp` (bf16 parameters / fp32 reduction on GPU).
Data is layout-independent: every rank reads the same global stream of rows, cut into micro-batches of
`batch_size` rows; at step s, accumulation a, batch rank i (of P = dp_shard·ep; the cp ranks of a group share
a coordinate and split the rows) takes global micro-batch number s·G + a·P + i with G = P·grad_accum, and the
step minimises the mean of the G micro-batch losses. So a run is defined by (batch_size, G): a layout with
P·grad_accum = G gives the same steps (to rounding) as one process with grad_accum = G, and a checkpoint
(`torch.distributed.checkpoint`: weights + optimizer; the global data position; schedule, RNG) resumes at any
layout with the same G. The price: every rank tokenises and packs the whole stream (P× the data work).

Pipeline parallelism (`--pp P`, `k3.parallel.pipeline`): each rank keeps the stage of its pp coordinate
(`split_stage`, before MoonEP / context parallelism / FSDP2, which apply to the stage), and the optimizer,
QK-clip and balancing cover the stage's parameters (their reductions run over the stage's ranks, `mesh.fsdp`).
A step is one `PipelineStep` with grad_accum micro-batches: batch rank i reads the same micro-batches
s·G + a·P + i (a < grad_accum) as without pp, and the pp ranks of a batch coordinate all read them, so a pp
layout trains the batches of one process with grad_accum = G. The clip norm is global (every stage), the loss
comes from the last stage (broadcast); validation runs the stages in turn (`PipelineStep.forward_loss`), the
same value as one process; sampling is skipped (one log line). Checkpoints: each stage saves its own keys
(the checkpoint's names) to `dcp/`, resumable at any layout with the same G; the HF export gathers every
stage's tensors on rank 0.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from .._atomic import atomic_write
from ..ops._host import to_device
from .config import TrainConfig
from .metrics import MetricsLog, plot_run, read_log
from .state import (DCP_DIR, STATE_FILE, clean_staging, commit_checkpoint, latest_checkpoint, latest_step,
                    load_state, rng_state, set_rng_state, stage_checkpoint, staging_dir, state_file, write_state)


class TrainingDiverged(RuntimeError):
    """The loss or gradient became NaN/Inf; the last good checkpoint is kept."""


def init_distributed() -> tuple[int, int, torch.device | None]:
    """(rank, world_size, device) in an initialised process group or under torchrun (WORLD_SIZE > 1),
    else (0, 1, None)."""
    if dist.is_initialized():
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        return dist.get_rank(), dist.get_world_size(), dev
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, None
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = None
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    return dist.get_rank(), world, device


class Trainer:
    progress_desc = "k3 train"  # the progress bar's label (subclasses: "k3 sft")

    def __init__(self, cfg: TrainConfig):
        from ..config import K3Config
        from ..io.tokenizer import K3Tokenizer, default_tokenizer
        from ..model import K3ForConditionalGeneration
        from .balance import BalanceController
        from .optim import OptimConfig, build_optimizer, build_scheduler
        from .qkclip import QKClip

        self.cfg = cfg = cfg.resolved()
        _check_inputs(cfg)  # missing/empty data or tokenizer: a clear error before anything is built or written
        self.rank, self.world, dev = init_distributed()
        self.device = torch.device(cfg.device) if cfg.device else (
            dev or torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        self.run_dir = Path(cfg.out)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)

        if cfg.init_from:
            self.model = K3ForConditionalGeneration.from_pretrained(cfg.init_from)
        else:
            mcfg = K3Config.from_pretrained(cfg.model_config) if cfg.model_config else K3Config.preset(cfg.preset)
            mcfg.vision_config = None  # text pre-training
            self.model = K3ForConditionalGeneration(mcfg)
        self.model.to(self.device).train()
        self.model_config = self.model.config  # under pp self.model becomes this rank's stage
        self.text_config = self.model_config.text_config
        self.num_params = self.model.num_parameters()
        if cfg.gradient_checkpointing:  # before any pipeline split: the stages copy the setting
            self.model.gradient_checkpointing_enable()
        if cfg.fp8:  # before sharding: the converted modules keep their parameters and names
            from ..ops.fp8 import convert_to_float8_training
            convert_to_float8_training(self.model)
        self.dims = cfg.layout(self.world)  # a bad layout fails here, naming its values
        if self.rank == 0:
            clean_staging(self.run_dir)
        self._barrier()
        self.resume_from = latest_checkpoint(self.run_dir) if cfg.resume else None
        if self.resume_from is not None and not (self.resume_from / DCP_DIR).is_dir():
            from ..model.state_dict import load_pretrained  # weights first: before sharding and the optimizer
            with torch.no_grad():
                self.model.load_state_dict(load_pretrained(
                    self.resume_from, dtype=next(self.model.parameters()).dtype).state_dict())
        self.mesh = self.pipe = None
        self.batch_rank, self.batch_world, self.cp_rank = 0, 1, 0
        if self.world > 1:
            self._parallelize()
        self.tokenizer = (K3Tokenizer.from_pretrained(cfg.tokenizer) if cfg.tokenizer
                          else default_tokenizer(self.text_config))
        if self.tokenizer.vocab_size > self.text_config.vocab_size:
            raise ValueError(f"tokenizer has {self.tokenizer.vocab_size} ids but the model's vocab_size is "
                             f"{self.text_config.vocab_size}")

        ocfg = OptimConfig(lr=cfg.lr, weight_decay=cfg.weight_decay)
        self._fold_clip = cfg.optimizer == "muon"  # MuonAdamW applies the clip coefficient as it reads gradients
        if cfg.optimizer == "muon":
            self.opt = build_optimizer(self.model, ocfg)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                         weight_decay=cfg.weight_decay)
        self.sched = build_scheduler(self.opt, cfg.steps, cfg.warmup_frac, cfg.min_lr_ratio)
        # QK-clip maxima and QB loads over every rank that holds these layers (all tokens of the step once)
        group = self.mesh.fsdp.get_group() if self.mesh is not None else None
        self.qkclip = QKClip(self.model, cfg.qk_clip_tau, group=group) if cfg.qk_clip_tau > 0 else None
        self.balance = None
        if cfg.balance != "none":
            self.balance = BalanceController(self.model, method="sign" if cfg.balance == "sign" else "qb",
                                             gamma=cfg.balance_gamma, exact=cfg.balance == "qb-exact",
                                             group=group)
        self.stages = cfg.stages()
        self.step = 0
        self.stage_idx = -1
        self.data = None
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else nullcontext())
        if self.global_stream is None:  # a subclass with its own data (_enter_stage) shards it by rank itself
            self.global_stream = type(self)._enter_stage is Trainer._enter_stage

    global_stream: bool | None = None  # every rank reads the one global stream (see the module docstring)

    def _parallelize(self) -> None:
        """Build the mesh of `self.dims` and apply it: under pp, keep this rank's pipeline stage
        (`self.model` becomes the stage, `self.pipe` its `PipelineStep`); MoonEP over `ep`, context
        parallelism over `cp`, then FSDP2 over `fsdp` when it has more than one rank (bf16 parameters / fp32
        gradient reduction on GPU, the parameters' dtype on CPU)."""
        from ..parallel.fsdp import apply_fsdp
        from ..parallel.mesh import build_mesh
        dims, tc = self.dims, self.text_config
        if dims.pp > 1 and type(self)._enter_stage is not Trainer._enter_stage:
            raise ValueError(f"pp={dims.pp}: pipeline stages run in k3 train (pre-training) only, not in "
                             f"{self.progress_desc}; use dp_shard, ep and cp")
        self.mesh = build_mesh(dims, self.device.type, tc, self.cfg.seq_len)
        self.batch_rank, self.batch_world = self.mesh.batch.get_local_rank(), dims.batch_parallel
        self.cp_rank = self.mesh.cp.get_local_rank()
        if dims.pp > 1:
            from ..parallel.pipeline import split_stage
            self.model = split_stage(self.model, self.mesh.pp.get_local_rank(), dims.pp, self.cfg.mtp_weight)
        if dims.ep > 1:
            from ..parallel.moonep import enable_expert_parallel
            enable_expert_parallel(self.model, self.mesh.ep.get_group())
        if dims.cp > 1:
            from ..parallel.cp import enable_context_parallel
            enable_context_parallel(self.model, self.mesh.cp.get_group())
        if dims.fsdp > 1:
            cuda = self.device.type == "cuda"
            apply_fsdp(self.model, self.mesh, param_dtype=torch.bfloat16 if cuda else None,
                       reduce_dtype=torch.float32 if cuda else None)
        if dims.pp > 1:  # micro-batches = grad_accum (see the module docstring); 1F1B needs at least pp of them
            from ..parallel.pipeline import PipelineStep
            n = self.cfg.grad_accum
            self.pipe = PipelineStep(self.model, self.mesh.pp.get_group(), n, mtp_weight=self.cfg.mtp_weight,
                                     schedule="1f1b" if n >= dims.pp else "gpipe", device=self.device,
                                     state_dtype=torch.bfloat16 if self.device.type == "cuda" else None)

    # ---- data --------------------------------------------------------------------------------------
    def _docs(self, split: str):
        from ..data.corpus import builtin_corpus
        from ..data.sources import open_sources
        cfg = self.cfg
        if cfg.data:  # a stable hash split of the user's documents gives the held-out set
            return lambda: open_sources(cfg.data, text_field=cfg.text_field, split=split)
        return lambda: iter(builtin_corpus(split=split))

    def _enter_stage(self, idx: int, data_state: dict | None = None) -> None:
        """Start curriculum stage `idx`: rows of the stage's length; the document stream continues where the
        previous stage left it (or where `data_state`, from a checkpoint, says). Long stages mix in the
        synthetic long-context task."""
        from ..data.packing import Mixture, PackedDataset
        stage = self.stages[idx]
        packed = PackedDataset(self._docs("train"), self.tokenizer, stage.seq_len, seed=self.cfg.seed)
        if data_state is None and self.data is not None:
            data_state = {"packed": self.packed.state_dict(), "mixture": None}
        if data_state is not None:
            packed.load_state_dict(data_state["packed"])
        self.stage_idx, self.packed, self.data = idx, packed, packed
        task = None
        if stage.seq_len > self.cfg.seq_len and self.cfg.long_context_frac > 0:
            task = self._long_context_task(stage.seq_len)
        if task is not None:
            f = self.cfg.long_context_frac
            self.data = Mixture([packed, task], [1 - f, f], seed=self.cfg.seed + idx)
            if data_state is not None and data_state.get("mixture") is not None:
                self.data.load_state_dict(data_state["mixture"])
        self.data_iter = iter(self.data)

    def _data_state(self) -> dict | None:
        if self.data is None:
            return None
        return {"packed": self.packed.state_dict(),
                "mixture": self.data.state_dict() if self.data is not self.packed else None}

    def _long_context_task(self, seq_len: int):
        """The synthetic long-context task at the most facts/hops that fit `seq_len` (None: nothing fits)."""
        from ..data.longctx import LongContextTask
        for n_facts, hops in ((16, 3), (8, 2), (4, 2), (2, 1), (1, 1)):
            try:
                return LongContextTask(self.tokenizer, seq_len, seed=self.cfg.seed + 7919,
                                       n_facts=n_facts, hops=hops)
            except ValueError:
                continue
        return None

    def _stage_for(self, step: int) -> int:
        return max(i for i, s in enumerate(self.stages) if s.start <= step)

    def _rows(self, rows: int) -> list[dict]:
        """This rank's next micro-batch of rows: from the global stream, the batch_world micro-batches of one
        accumulation round are read and the batch_rank-th kept (see the module docstring)."""
        mine = None
        for j in range(self.batch_world if self.global_stream else 1):
            r = [next(self.data_iter) for _ in range(rows)]
            if j == self.batch_rank or not self.global_stream:
                mine = r
        return mine

    def _batch(self, rows: int) -> dict:
        """This rank's next micro-batch (`_rows`), collated on the device (its cp share under cp)."""
        from ..data.packing import collate
        b = collate(self._rows(rows))
        return self._cp_shard({k: _to_device(k, v, self.device) for k, v in b.items()})

    def _pipeline_batch(self, rows: int) -> dict:
        """Under pp: this rank's grad_accum micro-batches of one step as one batch of whole rows, in order (the
        pipeline cuts it into the micro-batches again, and into cp shards itself)."""
        from ..data.packing import collate
        b = collate([r for _ in range(self.cfg.grad_accum) for r in self._rows(rows)])
        return {k: _to_device(k, v, self.device) for k, v in b.items()}

    def _cp_shard(self, b: dict) -> dict:
        """Under context parallelism: this cp rank's share of a whole micro-batch (`k3.parallel.cp.shard_batch`:
        its tokens, and the whole micro-batch's targets and their count, so the cp ranks' losses sum to it)."""
        if self.dims.cp == 1:
            return b
        from ..parallel.cp import shard_batch
        n_mtp = len(self.model.language_model.model.mtp_layers)
        return shard_batch({"input_ids": b["input_ids"], "labels": self._hf_labels(b), "cu_seqlens": b["cu_seqlens"]},
                           self.cp_rank, self.dims.cp, n_mtp)

    def _val_batches(self, max_rows: int = 20000) -> list[dict]:
        """Fixed validation rows spread evenly over the held-out split (its first `max_rows` rows), so the
        estimate is not dominated by whichever documents come first."""
        if not hasattr(self, "_val"):
            from ..data.packing import PackedDataset, collate
            need = self.cfg.eval_batches * self.cfg.batch_size
            rows = []
            for r in PackedDataset(self._docs("validation"), self.tokenizer, self.cfg.seq_len, seed=0, loop=False):
                rows.append(r)
                if len(rows) >= max_rows:
                    break
            if not rows:
                raise ValueError("the validation split is empty: no held-out documents to evaluate on")
            pick = [rows[(i * len(rows)) // need] for i in range(need)]
            B = self.cfg.batch_size
            self._val = [collate(pick[i:i + B]) for i in range(0, need, B)]
        return self._val

    # ---- model calls -------------------------------------------------------------------------------
    @staticmethod
    def _hf_labels(b: dict) -> torch.Tensor:
        """Data labels are next-token targets at t (−100: none); the model's labels are HF-style (target
        of position t sits at t + 1)."""
        lab = b["labels"]
        return torch.cat([torch.full_like(lab[:, :1], -100), lab[:, :-1]], dim=1)

    def _loss(self, b: dict):
        with self.autocast:
            if "targets" in b:  # a cp shard
                out = self.model(b["input_ids"], cu_seqlens=b["cu_seqlens"], targets=b["targets"],
                                 num_targets=b["num_targets"])
            else:
                out = self.model(b["input_ids"], labels=self._hf_labels(b), cu_seqlens=b["cu_seqlens"])
        loss = out.loss
        if out.mtp_loss is not None and self.cfg.mtp_weight > 0:
            loss = loss + self.cfg.mtp_weight * out.mtp_loss
        return loss, out

    @torch.no_grad()
    def evaluate(self) -> float | None:
        vb = self._val_batches()
        if not vb:
            return None
        self.model.eval()
        tot = torch.zeros(2, dtype=torch.float64, device=self.device)
        weights = [1.0] * len(vb)
        if self.global_stream and self.batch_world > 1:  # the global batches dealt out; every rank runs as many
            P = self.batch_world                            # forwards (collectives), padding with weight 0
            mine = vb[self.batch_rank::P]
            n_pad = -(-len(vb) // P) - len(mine)
            vb, weights = mine + [vb[0]] * n_pad, [1.0] * len(mine) + [0.0] * n_pad
        for b, w in zip(vb, weights):
            b = {k: v.to(self.device) for k, v in b.items()}
            n = (self._hf_labels(b)[:, 1:] != -100).sum().double() * w  # the whole micro-batch's targets
            if self.pipe is not None:  # the stages in turn; the last one's loss, broadcast
                with self.autocast:
                    loss = self.pipe.forward_loss(b["input_ids"], self._hf_labels(b), b["cu_seqlens"])[0]
            else:
                loss = self._loss(self._cp_shard(b))[1].loss
            # under cp each rank's loss is its share (the shares sum to the micro-batch's loss): n counted once
            tot += torch.stack([torch.where(n > 0, loss.double() * n, 0.0), n / self.dims.cp])
        if self.world > 1:  # (under pp every stage holds the same sums: the ratio is unchanged)
            dist.all_reduce(tot)
        self.model.train()
        return (tot[0] / tot[1]).item()

    @torch.no_grad()
    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None, seed: int = 0) -> str | None:
        """Sampled continuation (temperature 0.8, top-p 0.95, fixed seed so it does not disturb training RNG).
        None under pipeline parallelism (no pipelined decoding: sampling is skipped, said once in the log)."""
        if self.pipe is not None:
            if self.rank == 0 and not getattr(self, "_said_no_sample", False):
                print(f"{self.progress_desc}: sampling is skipped under pipeline parallelism (pp={self.dims.pp})",
                      flush=True)
                self._said_no_sample = True
            return None
        prompt = self.cfg.sample_prompt if prompt is None else prompt
        ids = [self.tokenizer.bos_token_id] + self.tokenizer.encode(prompt)
        self.model.eval()
        cp = _suspend_context_parallel(self.model)  # every cp rank generates the whole sequence itself
        try:
            with self.autocast:
                out = self.model.generate(torch.tensor([ids], device=self.device),
                                          max_new_tokens=max_new_tokens or self.cfg.sample_tokens,
                                          temperature=0.8, top_p=0.95, eos_token_id=self.tokenizer.eod_token_id,
                                          generator=torch.Generator(self.device).manual_seed(seed))
        finally:
            _resume_context_parallel(cp)
            self.model.train()
        return prompt + self.tokenizer.decode(out[0, len(ids):].tolist(), skip_special=True)

    # ---- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The trainer state beside the weights. Distributed, the optimizer's tensors go to the DCP folder and
        only its group settings (lr, …) stay here; `layout` records the mesh sizes (pp, dp_shard, cp, ep)."""
        if self.mesh is not None:
            opt = {"groups": self._group_settings()}
        else:
            opt = self.opt.state_dict()
        return {"step": self.step, "stage": self.stage_idx, "optimizer": opt, "layout": list(self.dims.sizes),
                "scheduler": self.sched.state_dict(),
                "qkclip": self.qkclip.state_dict() if self.qkclip else None,
                "balance": self.balance.state_dict() if self.balance else None,
                "data": self._data_state(),
                "rng": rng_state(), "config": self.cfg.to_dict(), "world_size": self.world}

    def _group_settings(self) -> list[dict]:
        """The optimizer's parameter-group settings (lr, kind, head_rows, …; no parameters). Under pp a
        collective over the pp group: the union of every stage's groups (a stage may lack a kind), so that
        any layout can find its groups' settings (`_restore_groups`)."""
        mine = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        if self.pipe is None:
            return mine
        every: list = [None] * self.dims.pp
        dist.all_gather_object(every, mine, group=self.mesh.pp.get_group())
        out = []
        for g in (g for stage in every for g in stage):
            if all(_group_key(g) != _group_key(o) for o in out):
                out.append(g)
        return out

    def _restore_groups(self, saved: list[dict], scheduler: dict, where: Path) -> None:
        """Put the saved group settings (matched by kind, head_rows and weight decay: the layout may differ, and
        with it the groups a pipeline stage holds) and the schedule's position back."""
        for g in self.opt.param_groups:
            match = [s for s in saved if _group_key(s) == _group_key(g)]
            if not match:
                raise ValueError(f"{where}: no saved optimizer group matches {_group_key(g)} (kind, head rows, "
                                 f"weight decay); saved: {[_group_key(s) for s in saved]} (another --optimizer or "
                                 "model?)")
            g.update(match[0])
        st = dict(scheduler)  # per-group lists follow this optimizer's groups (every group has the same lambda)
        st["lr_lambdas"] = [scheduler["lr_lambdas"][0]] * len(self.opt.param_groups)
        st["base_lrs"] = [g["initial_lr"] for g in self.opt.param_groups]
        st["_last_lr"] = [g["lr"] for g in self.opt.param_groups]
        self.sched.load_state_dict(st)

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def save(self) -> Path | None:
        """Atomic checkpoint of every rank's state (a collective when distributed): rank 0 stages the model in
        the release's HF layout (distributed: full tensors gathered one at a time), every rank adds its trainer
        state — distributed, also its shards of the weights and optimizer state into `dcp/`
        (`torch.distributed.checkpoint`, loadable at any layout) — and rank 0 commits. The step `latest` already
        names (a resumed run that trained no further) is not written again."""
        if latest_step(self.run_dir) == self.step:
            return latest_checkpoint(self.run_dir)
        staging = staging_dir(self.run_dir, self.step)
        if self.mesh is None:
            if self.rank == 0:
                stage_checkpoint(self.run_dir, self.step, self.model, self.tokenizer)
        else:
            from ..parallel.dcp import full_state_dict, gather_pipeline_state_dict, save_model
            full = full_state_dict(self.model, self.mesh)  # collective; rank 0 (of the stage) keeps the tensors
            if self.pipe is not None:  # every stage's tensors to global rank 0
                full = gather_pipeline_state_dict(full, self.mesh, self.device)
            if self.rank == 0:
                stage_checkpoint(self.run_dir, self.step, self._export_model(full), self.tokenizer)
            del full
            self._barrier()
            save_model(self.model, staging / DCP_DIR, self.mesh, self.opt)
        self._barrier()
        write_state(staging, self.rank, self.state_dict())
        self._barrier()
        final = commit_checkpoint(self.run_dir, self.step, self.cfg.keep_checkpoints) if self.rank == 0 else None
        self._barrier()
        return final

    def _export_model(self, full: dict):
        """A plain model (no parallelism) holding the gathered tensors `full` (no copy): what save_pretrained
        writes."""
        from ..model import K3ForConditionalGeneration
        with torch.device("meta"):
            m = K3ForConditionalGeneration(self.model_config, init=False)
        m.load_state_dict(full, assign=True)
        return m

    def _resume_dcp(self, ck: Path) -> None:
        """Resume from a distributed checkpoint at any layout (or one process): weights and optimizer state from
        `dcp/` (resharded by DCP), the rest from rank 0's trainer state (the data position is global); each
        rank's RNG from its own file when the world size is unchanged, else rank 0's."""
        from ..parallel.dcp import load_model
        st = load_state(ck / STATE_FILE)
        own = ck / state_file(self.rank)
        rng = st["rng"]
        if self.rank > 0 and own.is_file() and st.get("world_size") == self.world:
            rng = load_state(own)["rng"]
        load_model(self.model, ck / DCP_DIR, self.mesh, self.opt)
        self._restore_groups(st["optimizer"]["groups"], st["scheduler"], ck)
        self._restore_loop(st, rng)

    def _restore_loop(self, st: dict, rng) -> None:
        """QK-clip, balancing, step, curriculum stage with its data position, and RNG from a checkpoint state."""
        if self.qkclip and st["qkclip"] is not None:
            self.qkclip.load_state_dict(st["qkclip"])
        if self.balance and st["balance"] is not None:
            self.balance.load_state_dict(st["balance"])
        self.step = st["step"]
        if st["stage"] >= 0:
            self._enter_stage(st["stage"], st["data"])
        set_rng_state(rng)

    def try_resume(self) -> bool:
        ck = self.resume_from
        if ck is None:
            return False
        if (ck / DCP_DIR).is_dir():
            self._resume_dcp(ck)
            return True
        if self.mesh is not None:
            raise ValueError(f"{ck} is a single-process checkpoint (no {DCP_DIR}/) and this run has {self.world} "
                             "ranks: resume it with one process, or start the distributed run from its weights "
                             "with --init-from and a new --out")
        path = ck / state_file(self.rank)
        if not path.is_file():
            raise FileNotFoundError(f"{ck} has no {path.name}: it was written by fewer ranks than this run's "
                                    f"{self.world}")
        st = load_state(path)
        if st.get("world_size", 1) != self.world:
            raise ValueError(f"{ck} was written by {st.get('world_size', 1)} ranks; this run has {self.world}")
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        self._restore_loop(st, st["rng"])
        return True

    def _merge_stage_stats(self, clip: dict, bal: dict) -> tuple[dict, dict]:
        """Under pp: the QK-clip statistics (largest logit, clipped heads) and the per-layer balancing maxvio of
        every stage (one all_gather_object over the pp group), as one process reports them."""
        def plain(v):
            return v.item() if torch.is_tensor(v) else v
        every: list = [None] * self.dims.pp
        dist.all_gather_object(every, ({k: plain(v) for k, v in clip.items()}, {k: plain(v) for k, v in bal.items()}),
                               group=self.mesh.pp.get_group())
        mx = [c["max_logit"] for c, _ in every if c.get("max_logit") is not None]
        heads = sum(c.get("clipped_heads", 0) for c, _ in every)
        clip = {"max_logit": max(mx) if mx else None, "clipped_heads": heads} if self.qkclip else {}
        return clip, {k: v for _, b in every for k, v in b.items()}

    # ---- the loop ------------------------------------------------------------------------------------
    def fit(self) -> dict:
        from tqdm import tqdm
        cfg = self.cfg
        resumed = self.try_resume()
        if resumed and self.step >= cfg.steps:  # nothing left to do: no second final evaluation, no re-save
            return finished_summary(self.run_dir, self.step)
        log = MetricsLog(self.run_dir, cfg.tensorboard, resume_step=self.step) if self.rank == 0 else _NullLog()
        if self.rank == 0:
            atomic_write(self.run_dir / "train_config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
        end = cfg.steps if cfg.stop_after is None else min(cfg.steps, self.step + cfg.stop_after)
        bar = tqdm(total=cfg.steps, initial=self.step, desc=self.progress_desc, unit="step", dynamic_ncols=True,
                   disable=not cfg.progress or self.rank != 0)
        first_val = self.evaluate() if self.step == 0 else None
        if first_val is not None and self.rank == 0:
            log.write("val", 0, loss=first_val)
        params = [p for p in self.model.parameters() if p.requires_grad]
        last = {}
        stats = _StepStats(self.rank == 0, self.run_dir)
        try:
            while self.step < end:
                idx = self._stage_for(self.step)
                if idx != self.stage_idx:
                    self._enter_stage(idx)
                stage = self.stages[idx]
                t0 = time.perf_counter()
                stats.begin(self.device)
                tot_loss = torch.zeros((), device=self.device)
                tot_mtp = torch.zeros((), device=self.device)
                ntok = 0
                if self.pipe is not None:  # the grad_accum micro-batches through the stages, forward + backward
                    b = self._pipeline_batch(stage.batch_size)
                    with self.autocast:
                        self.pipe(b["input_ids"], self._hf_labels(b), b["cu_seqlens"])
                    tot_loss, tot_mtp = self.pipe.lm_loss.to(tot_loss), self.pipe.mtp_loss.to(tot_mtp)
                    ntok = b["input_ids"].numel()
                for _ in range(cfg.grad_accum if self.pipe is None else 0):  # FSDP2 reduce-scatters each one
                    b = self._batch(stage.batch_size)
                    loss, out = self._loss(b)
                    (loss / cfg.grad_accum).backward()
                    tot_loss += out.loss.detach() / cfg.grad_accum
                    if out.mtp_loss is not None:
                        tot_mtp += out.mtp_loss.detach() / cfg.grad_accum
                    ntok += b["input_ids"].numel()
                max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
                gscale = None  # the clip coefficient, when the optimizer applies it (MuonAdamW, one process)
                if self.world > 1:  # gradients: FSDP2 reduced them (mean over the batch ranks); losses likewise
                    both = torch.stack([tot_loss, tot_mtp])  # a stage's ranks (under pp all hold the same)
                    dist.all_reduce(both, group=self.mesh.fsdp.get_group())
                    tot_loss, tot_mtp = both / self.batch_world
                    if self.pipe is not None:  # global norm: every stage, shard and EP slice counted once
                        from ..parallel.pipeline import clip_grad_norm_ as clip_stages
                        gnorm = clip_stages(self.model, max_norm, self.mesh.pp.get_group(),
                                            self.mesh.ep.get_group() if self.dims.ep > 1 else None)
                    else:
                        from ..parallel.fsdp import clip_grad_norm_
                        gnorm = clip_grad_norm_(params, max_norm)  # global norm over every shard
                elif self._fold_clip:  # MuonAdamW: clipping folded into the step's gradient reads
                    from .optim import grad_clip_scale
                    gnorm, gscale = grad_clip_scale(params, max_norm)
                else:
                    gnorm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                # no host read here: the losses and norm are checked one step later (`_StepStats`), so the host
                # issues the optimizer and the next step while the GPU still runs this one
                self.opt.step() if gscale is None else self.opt.step(grad_scale=gscale)
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                sync = self.pipe is not None  # else the statistics stay on the device until the next read
                clip = self.qkclip.step(sync=sync) if self.qkclip else {}
                bal = self.balance.step(sync=sync) if self.balance else {}
                if self.pipe is not None:  # each stage saw its own layers: the whole model's statistics
                    clip, bal = self._merge_stage_stats(clip, bal)
                self.step += 1
                dt = time.perf_counter() - t0
                tps = ntok * self.batch_world / dt
                last = {"lr": self.sched.get_last_lr()[0], "tokens_per_s": tps, "seq_len": stage.seq_len,
                        "step_time_s": dt}  # + the losses, norm and statistics, once read
                # reads the previous step's values (long computed: no wait) and keeps this one's
                stats.hold(self.step, last, {"loss": tot_loss, "grad_norm": gnorm, "mtp_loss": tot_mtp}, clip, bal, log)
                bar.update(1)
                if stats.shown:  # the latest step read (the one before this, on a GPU)
                    bar.set_postfix(loss=f"{stats.shown['loss']:.3f}", tok_s=f"{stats.shown['tokens_per_s']:,.0f}",
                                    seq=stage.seq_len, refresh=False)
                if self.step >= end or any(n and self.step % n == 0
                                           for n in (cfg.eval_every, cfg.sample_every, cfg.save_every)):
                    stats.flush(log)  # the log holds every row up to a checkpoint, an evaluation, the end
                    if self.balance:
                        self.balance.raise_pending()  # a deferred range check of the step just ended
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    v = self.evaluate()
                    if v is not None and self.rank == 0:
                        log.write("val", self.step, loss=v)
                        bar.write(f"step {self.step}: validation loss {v:.4f}")
                if cfg.sample_every and self.step % cfg.sample_every == 0 and self.step < cfg.steps:
                    text = self.sample()  # on every rank: identical seeds, and EP forwards are collective
                    if self.rank == 0 and text is not None:
                        log.write("sample", self.step, text=text)
                        bar.write(f"step {self.step} sample: {text[:200]!r}")
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save()
            if not cfg.save_every or self.step % cfg.save_every != 0:
                self.save()
            finished = self.step >= cfg.steps
            if finished:
                v = self.evaluate()  # collective (and the model forward is, under EP): every rank runs these
                text = self.sample()
                if v is not None:
                    log.write("val", self.step, loss=v)
                if text is not None:
                    log.write("sample", self.step, text=text)
        finally:
            stats.flush(log, quiet=True)  # a step's row is not lost to an error raised after it
            bar.close()
            log.close()
        summary = {"step": self.step, "finished": finished, "resumed": resumed, **last}
        if finished and self.rank == 0:
            vals = [r for r in read_log(self.run_dir / "log.jsonl") if r["kind"] == "val"]
            summary.update(first_val_loss=vals[0]["loss"] if vals else None, final_val_loss=v, sample=text,
                           checkpoint=str(latest_checkpoint(self.run_dir)),
                           plot=str(plot_run(self.run_dir)), params=self.num_params)
            atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary


def _to_device(key: str, t: torch.Tensor, device) -> torch.Tensor:
    """A collated batch's tensor on the device; cu_seqlens with its host values kept (`varlen.bounds_to`), so the
    forward's checks and KDA chunk tables read nothing back from the GPU. To a GPU through pinned memory without
    blocking: a copy from pageable memory waits for the stream to drain, which would stall the host at every
    batch while the GPU still runs the previous step."""
    if key == "cu_seqlens":
        from ..ops.varlen import bounds_to
        return bounds_to(t, device)
    return to_device(t, device)


def _group_key(g: dict) -> tuple:
    """What tells an optimizer's parameter groups apart across layouts: (kind, head_rows, weight_decay)."""
    return (g.get("kind"), g.get("head_rows"), g.get("weight_decay"))


def _suspend_context_parallel(model) -> list:
    """Detach the context-parallel executors (`k3.parallel.cp`) from the model's modules; returns what
    `_resume_context_parallel` puts back ([] when the model runs without)."""
    saved = [(m, m.context_parallel) for m in model.modules() if getattr(m, "context_parallel", None) is not None]
    for m, _ in saved:
        m.context_parallel = None
    return saved


def _resume_context_parallel(saved: list) -> None:
    for m, cp in saved:
        m.context_parallel = cp


class _StepStats:
    """A step's losses, gradient norm, and QK-clip and balancing statistics, read one step late. They stay on the
    device, copied (non-blocking) into pinned host memory behind an event, and are read when the next step has been
    issued, or at a flush (before a checkpoint, an evaluation, the end), when they have long been computed: the
    loop never waits for the GPU, so the host issues step i+1 while the GPU still runs step i. A non-finite loss or
    gradient norm raises `TrainingDiverged` when read, before any later checkpoint is written, so the last one on
    disk is good. The step's train row (a dict the trainer also returns) is completed and written then. On a GPU its
    step time and tokens/s are the GPU's, between events at the step's start and end: the host's own time to issue
    a step no longer waits for the GPU, so it says little about throughput."""

    KEYS = ("loss", "grad_norm", "mtp_loss", "max_logit", "clipped_heads", "maxvio_mean", "maxvio_max")

    def __init__(self, write: bool, run_dir: Path):
        self.write, self.run_dir = write, run_dir
        self.pending = None  # (step, row, keys, host values, end event, start event) (events: None off CUDA)
        self.shown: dict = {}  # the latest values read (the progress bar's)
        self.last_ev = None  # the previous step's end event: the next step's start

    def begin(self, device) -> None:
        """Mark a step's start on the GPU's stream where no step's end marks it: the first step, and the first after
        a flush (a checkpoint's or an evaluation's host work is not a step's)."""
        if self.last_ev is None and torch.device(device).type == "cuda":
            self.last_ev = torch.cuda.Event(enable_timing=True)
            self.last_ev.record()

    def hold(self, step: int, row: dict, now: dict, clip: dict, bal: dict, log) -> None:
        """Read the pending step's values (`flush`), then keep this step's: `now` (0-dim device tensors: losses,
        norm) and the statistics (device tensors, or numbers where they were read already)."""
        self._read(log)
        vals = {k: v for k, v in now.items() if v is not None}
        vals.update({k: clip[k] for k in ("max_logit", "clipped_heads") if clip.get(k) is not None})
        vio = [torch.as_tensor(v).reshape(()) for v in (bal or {}).values() if v is not None]
        if vio:  # per-MoE-layer maxvio of this step's loads
            t = torch.stack([v.to(vio[0].device, torch.float64) for v in vio])
            vals.update(maxvio_mean=t.mean(), maxvio_max=t.amax())
        ts = [torch.as_tensor(v) for v in vals.values()]
        dev = next((t.device for t in ts if t.device.type != "cpu"), torch.device("cpu"))
        both = torch.stack([t.to(dev, torch.float64).reshape(()) for t in ts])  # fp64: a loss's fp32 value exactly
        ev = None
        if dev.type == "cuda":
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        else:
            host = both
        self.pending = (step, row, list(vals), host, ev, self.last_ev)
        self.last_ev = ev

    def flush(self, log, quiet: bool = False) -> None:
        """Read and write the pending row (a wait for its event, if the GPU is still short of it); quiet: drop it on
        an error (a broken device, or the divergence being raised already). The next step's time starts afresh."""
        self.last_ev = None
        self._read(log, quiet)

    def _read(self, log, quiet: bool = False) -> None:
        if self.pending is None:
            return
        step, row, keys, host, ev, start = self.pending
        self.pending = None
        try:
            if ev is not None:
                ev.synchronize()
            vals = dict(zip(keys, host.tolist()))
            gpu_s = start.elapsed_time(ev) / 1e3 if ev is not None and start is not None else None
        except Exception:
            if quiet:
                return
            raise
        lv, gv = vals.get("loss", 0.0), vals.get("grad_norm", 0.0)
        if not (math.isfinite(lv) and math.isfinite(gv)):
            if quiet:
                return
            raise TrainingDiverged(
                f"step {step}: non-finite {'loss' if not math.isfinite(lv) else 'gradient norm'} "
                f"(loss={lv}, grad_norm={gv}); the last good checkpoint is kept "
                f"({latest_checkpoint(self.run_dir) or 'none written yet'})")
        if vals.get("max_logit") == float("-inf"):  # no MLA layer saw a training forward
            vals.pop("max_logit")
        if "clipped_heads" in vals:
            vals["clipped_heads"] = int(vals["clipped_heads"])
        if gpu_s and row.get("step_time_s"):  # the same tokens over the GPU's time
            row["tokens_per_s"] *= row["step_time_s"] / gpu_s
            row["step_time_s"] = gpu_s
        rest = dict(row)  # the row reads loss first, as before the values were read late
        row.clear()
        row.update({k: vals[k] for k in self.KEYS if k in vals}, **rest)
        self.shown = row
        if self.write:
            log.write("train", step, **row)


class _NullLog:
    """Ranks other than 0 log nothing."""

    def write(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def finished_summary(run_dir: str | os.PathLike, step: int) -> dict:
    """What a finished run reports when asked to train again: its summary.json plus `already_finished`."""
    p = Path(run_dir) / "summary.json"
    try:
        s = json.loads(p.read_text()) if p.is_file() else {}
    except ValueError:
        s = {}
    s.update(step=step, finished=True, already_finished=True, resumed=True,
             checkpoint=str(latest_checkpoint(run_dir)))
    return s


def _check_inputs(cfg: TrainConfig) -> None:
    from ..data.sources import check_sources
    if cfg.tokenizer and not Path(cfg.tokenizer).exists():
        raise FileNotFoundError(f"tokenizer {cfg.tokenizer!r} does not exist")
    for name in ("model_config", "init_from"):
        v = getattr(cfg, name)
        if v and not Path(v).exists():
            raise FileNotFoundError(f"{name.replace('_', '-')} {v!r} does not exist")
    if cfg.data:
        check_sources(cfg.data, cfg.text_field)


def preflight(cfg: TrainConfig) -> dict | None:
    """Every check that needs no model, before anything is built or written: settings, data, tokenizer and the
    state of `out`. Returns the finished run's summary when `out` already reached `steps` (nothing to do), None
    when training should start or continue."""
    cfg = cfg.resolved()
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={cfg.out!r} exists and is not a directory")
    step = latest_step(out) if out.is_dir() else None
    if step is not None:
        if not cfg.resume:
            raise ValueError(f"out={cfg.out!r} already holds a run (its latest checkpoint is step {step}): give a "
                             "new --out to start over, or leave out --no-resume to continue it")
        latest_checkpoint(out)  # a dangling `latest` is an error here, not after the model is built
        if step >= cfg.steps:
            return finished_summary(out, step)
    _check_inputs(cfg)
    return None


def train(cfg: TrainConfig) -> dict:
    """`k3 train`: preflight, then train. A run that fails before its first checkpoint leaves no `out` behind
    (when it created it); a finished run is not trained again (the summary says `already_finished`)."""
    done = preflight(cfg)
    if done is not None:
        return done
    out = Path(cfg.out)
    created = not out.exists()
    try:
        return Trainer(cfg).fit()
    except BaseException:
        if created and int(os.environ.get("RANK", "0")) == 0 and latest_step(out) is None:
            shutil.rmtree(out, ignore_errors=True)
        raise
