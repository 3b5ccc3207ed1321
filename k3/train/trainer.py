"""The pre-training loop behind `k3 train` (K3_SPEC §7).

Per step: `grad_accum` micro-batches of packed documents (KDA state, short convs, MLA attention and the
losses never cross a document boundary), LM loss + `mtp_weight` × MTP loss, gradient clipping, Per-Head
Muon + AdamW, the cosine schedule, QK-clip on the MLA heads, the router's selection bias updated by
Quantile Balancing. The context-length curriculum changes the row length at stage boundaries while
keeping the tokens per step. bf16 autocast on GPU, fp32 on CPU.

Resume is exact: a checkpoint holds the weights, optimizer, schedule, QK-clip and balancing state, the
data position and every RNG, so stopping at step N and resuming reproduces an uninterrupted run (bitwise on
CPU). A non-finite loss stops the run, naming the step, and keeps the last good checkpoint.
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
from .config import TrainConfig
from .metrics import MetricsLog, plot_run, read_log
from .state import (clean_staging, commit_checkpoint, latest_checkpoint, latest_step, load_state, rng_state,
                    set_rng_state, stage_checkpoint, staging_dir, state_file, write_state)


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
        if self.rank == 0:
            clean_staging(self.run_dir)
        self._barrier()
        self.resume_from = latest_checkpoint(self.run_dir) if cfg.resume else None
        if self.resume_from is not None:  # weights first: before expert sharding and the optimizer
            from ..model.state_dict import load_pretrained
            with torch.no_grad():
                self.model.load_state_dict(load_pretrained(
                    self.resume_from, dtype=next(self.model.parameters()).dtype).state_dict())
        self.expert_parallel = cfg.expert_parallel
        if cfg.expert_parallel:
            if self.world < 2:
                raise ValueError("expert_parallel needs several ranks: launch with torchrun --nproc_per_node=N")
            from ..parallel.moonep import enable_expert_parallel
            enable_expert_parallel(self.model, group=None)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.text_config = self.model.config.text_config
        self.tokenizer = (K3Tokenizer.from_pretrained(cfg.tokenizer) if cfg.tokenizer
                          else default_tokenizer(self.text_config))
        if self.tokenizer.vocab_size > self.text_config.vocab_size:
            raise ValueError(f"tokenizer has {self.tokenizer.vocab_size} ids but the model's vocab_size is "
                             f"{self.text_config.vocab_size}")

        ocfg = OptimConfig(lr=cfg.lr, weight_decay=cfg.weight_decay)
        if cfg.optimizer == "muon":
            self.opt = build_optimizer(self.model, ocfg)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                         weight_decay=cfg.weight_decay)
        self.sched = build_scheduler(self.opt, cfg.steps, cfg.warmup_frac, cfg.min_lr_ratio)
        self.qkclip = QKClip(self.model, cfg.qk_clip_tau) if cfg.qk_clip_tau > 0 else None
        self.balance = None
        if cfg.balance != "none":
            self.balance = BalanceController(self.model, method="sign" if cfg.balance == "sign" else "qb",
                                             gamma=cfg.balance_gamma, exact=cfg.balance == "qb-exact",
                                             group=dist.group.WORLD if self.world > 1 else None)
        self.stages = cfg.stages()
        self.step = 0
        self.stage_idx = -1
        self.data = None
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else nullcontext())

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
        packed = PackedDataset(self._docs("train"), self.tokenizer, stage.seq_len, rank=self.rank,
                               world_size=self.world, seed=self.cfg.seed)
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
                return LongContextTask(self.tokenizer, seq_len, seed=self.cfg.seed + 7919 * (self.rank + 1),
                                       n_facts=n_facts, hops=hops)
            except ValueError:
                continue
        return None

    def _stage_for(self, step: int) -> int:
        return max(i for i, s in enumerate(self.stages) if s.start <= step)

    def _batch(self, rows: int) -> dict:
        from ..data.packing import collate
        b = collate([next(self.data_iter) for _ in range(rows)])
        return {k: v.to(self.device) for k, v in b.items()}

    def _val_batches(self, max_rows: int = 20000) -> list[dict]:
        """Fixed validation rows spread evenly over the held-out split (its first `max_rows` rows), so the
        estimate is not dominated by whichever documents come first."""
        if not hasattr(self, "_val"):
            from ..data.packing import PackedDataset, collate
            need = self.cfg.eval_batches * self.cfg.batch_size
            rows = []
            for r in PackedDataset(self._docs("validation"), self.tokenizer, self.cfg.seq_len, rank=self.rank,
                                   world_size=self.world, seed=0, loop=False):
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
        for b in vb:
            b = {k: v.to(self.device) for k, v in b.items()}
            _, out = self._loss(b)
            n = (self._hf_labels(b)[:, 1:] != -100).sum()
            tot += torch.stack([out.loss.double() * n, n.double()])
        if self.world > 1:
            dist.all_reduce(tot)
        self.model.train()
        return (tot[0] / tot[1]).item()

    @torch.no_grad()
    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None, seed: int = 0) -> str:
        """Sampled continuation (temperature 0.8, top-p 0.95, fixed seed so it does not disturb training RNG)."""
        prompt = self.cfg.sample_prompt if prompt is None else prompt
        ids = [self.tokenizer.bos_token_id] + self.tokenizer.encode(prompt)
        self.model.eval()
        try:
            with self.autocast:
                out = self.model.generate(torch.tensor([ids], device=self.device),
                                          max_new_tokens=max_new_tokens or self.cfg.sample_tokens,
                                          temperature=0.8, top_p=0.95, eos_token_id=self.tokenizer.eod_token_id,
                                          generator=torch.Generator(self.device).manual_seed(seed))
        finally:
            self.model.train()
        return prompt + self.tokenizer.decode(out[0, len(ids):].tolist(), skip_special=True)

    # ---- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "stage": self.stage_idx, "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(),
                "qkclip": self.qkclip.state_dict() if self.qkclip else None,
                "balance": self.balance.state_dict() if self.balance else None,
                "data": self._data_state(),
                "rng": rng_state(), "config": self.cfg.to_dict(), "world_size": self.world}

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def save(self) -> Path | None:
        """Atomic checkpoint of every rank's state (a collective when distributed): rank 0 stages the model
        (experts gathered under EP), every rank adds its trainer state, rank 0 commits. The step `latest` already
        names (a resumed run that trained no further) is not written again."""
        if latest_step(self.run_dir) == self.step:
            return latest_checkpoint(self.run_dir)
        ctx = nullcontext()
        if self.expert_parallel:
            from ..parallel.moonep import gathered_experts
            ctx = gathered_experts(self.model)
        with ctx:
            if self.rank == 0:
                stage_checkpoint(self.run_dir, self.step, self.model, self.tokenizer)
        self._barrier()
        write_state(staging_dir(self.run_dir, self.step), self.rank, self.state_dict())
        self._barrier()
        final = commit_checkpoint(self.run_dir, self.step, self.cfg.keep_checkpoints) if self.rank == 0 else None
        self._barrier()
        return final

    def try_resume(self) -> bool:
        ck = self.resume_from
        if ck is None:
            return False
        path = ck / state_file(self.rank)
        if not path.is_file():
            raise FileNotFoundError(f"{ck} has no {path.name}: it was written by fewer ranks than this run's "
                                    f"{self.world}")
        st = load_state(path)
        if st.get("world_size", 1) != self.world:
            raise ValueError(f"{ck} was written by {st.get('world_size', 1)} ranks; this run has {self.world}")
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        if self.qkclip and st["qkclip"] is not None:
            self.qkclip.load_state_dict(st["qkclip"])
        if self.balance and st["balance"] is not None:
            self.balance.load_state_dict(st["balance"])
        self.step = st["step"]
        if st["stage"] >= 0:
            self._enter_stage(st["stage"], st["data"])
        set_rng_state(st["rng"])
        return True

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
        try:
            while self.step < end:
                idx = self._stage_for(self.step)
                if idx != self.stage_idx:
                    self._enter_stage(idx)
                stage = self.stages[idx]
                t0 = time.perf_counter()
                tot_loss = torch.zeros((), device=self.device)
                tot_mtp = torch.zeros((), device=self.device)
                ntok = 0
                for _ in range(cfg.grad_accum):
                    b = self._batch(stage.batch_size)
                    loss, out = self._loss(b)
                    (loss / cfg.grad_accum).backward()
                    tot_loss += out.loss.detach() / cfg.grad_accum
                    if out.mtp_loss is not None:
                        tot_mtp += out.mtp_loss.detach() / cfg.grad_accum
                    ntok += b["input_ids"].numel()
                max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
                if self.world > 1:
                    from ..parallel.moonep import sync_data_parallel_grads
                    dist.all_reduce(tot_loss)
                    tot_loss /= self.world
                    sync_data_parallel_grads(self.model)  # mean over ranks; sharded expert grads are not summed twice
                if self.expert_parallel:
                    from ..parallel.moonep import clip_grad_norm_
                    gnorm = clip_grad_norm_(self.model, max_norm)
                else:
                    gnorm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                lv, gv, mv = torch.stack([tot_loss, gnorm.to(tot_loss), tot_mtp]).tolist()  # one host sync
                if not (math.isfinite(lv) and math.isfinite(gv)):
                    raise TrainingDiverged(
                        f"step {self.step + 1}: non-finite {'loss' if not math.isfinite(lv) else 'gradient norm'} "
                        f"(loss={lv}, grad_norm={gv}); the last good checkpoint is kept "
                        f"({latest_checkpoint(self.run_dir) or 'none written yet'})")
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                clip = self.qkclip.step() if self.qkclip else {}
                bal = self.balance.step() if self.balance else {}
                self.step += 1
                dt = time.perf_counter() - t0
                tps = ntok * self.world / dt
                last = {"loss": lv, "mtp_loss": mv, "grad_norm": gv,
                        "lr": self.sched.get_last_lr()[0], "tokens_per_s": tps, "seq_len": stage.seq_len,
                        "step_time_s": dt}
                last.update({k: v for k, v in (clip or {}).items() if isinstance(v, (int, float))})
                vio = [v for v in (bal or {}).values() if isinstance(v, (int, float))]
                if vio:  # per-MoE-layer maxvio of this step's loads
                    last.update(maxvio_mean=sum(vio) / len(vio), maxvio_max=max(vio))
                if self.rank == 0:
                    log.write("train", self.step, **last)
                bar.update(1)
                bar.set_postfix(loss=f"{lv:.3f}", tok_s=f"{tps:,.0f}", seq=stage.seq_len, refresh=False)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    v = self.evaluate()
                    if v is not None and self.rank == 0:
                        log.write("val", self.step, loss=v)
                        bar.write(f"step {self.step}: validation loss {v:.4f}")
                if cfg.sample_every and self.step % cfg.sample_every == 0 and self.step < cfg.steps:
                    text = self.sample()  # on every rank: identical seeds, and EP forwards are collective
                    if self.rank == 0:
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
                log.write("sample", self.step, text=text)
        finally:
            bar.close()
            log.close()
        summary = {"step": self.step, "finished": finished, "resumed": resumed, **last}
        if finished and self.rank == 0:
            vals = [r for r in read_log(self.run_dir / "log.jsonl") if r["kind"] == "val"]
            summary.update(first_val_loss=vals[0]["loss"] if vals else None, final_val_loss=v, sample=text,
                           checkpoint=str(latest_checkpoint(self.run_dir)),
                           plot=str(plot_run(self.run_dir)), params=self.model.num_parameters())
            atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary


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
