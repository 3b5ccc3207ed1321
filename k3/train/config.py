"""`TrainConfig`: every knob of `k3 train`, from defaults, a TOML/YAML file and CLI flags (in that order)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

PRESET_DEFAULTS = {
    # preset: (seq_len, tokens per optimizer step, lr) — the k3-tiny numbers fit a 2-core CPU in minutes
    "k3-tiny": (256, 2048, 3e-3),
    "k3-small": (4096, 262144, 1e-3),
}


@dataclass
class Stage:
    """One context-length stage of the curriculum: from `start` (a step) on, rows of `seq_len` tokens."""

    start: int
    seq_len: int
    batch_size: int


@dataclass
class TrainConfig:
    # model
    preset: str = "k3-tiny"
    model_config: str | None = None  # a config.json / checkpoint dir instead of a preset
    init_from: str | None = None  # start from these weights (HF layout)
    # data
    data: list[str] = field(default_factory=list)  # empty: the built-in corpus
    text_field: str = "text"
    tokenizer: str | None = None  # a tokenizer dir (tiktoken.model or ours); None: BPE on the built-in corpus
    seq_len: int | None = None  # base context length (None: the preset's)
    batch_size: int | None = None  # rows per micro-batch at the base length (None: tokens_per_step / seq_len)
    tokens_per_step: int | None = None
    grad_accum: int = 1
    curriculum: str = "auto"  # "auto", "none", or "frac:mult,..." e.g. "0.85:1,0.15:4" (mult × seq_len)
    long_context_frac: float = 0.1  # share of long-stage rows drawn from the synthetic long-context task
    # optimisation
    steps: int = 200
    optimizer: str = "muon"  # "muon" (Per-Head Muon + AdamW) or "adamw"
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.01
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    qk_clip_tau: float = 100.0  # 0 disables QK-clip
    balance: str = "qb"  # "qb" (histogram, one all_reduce) | "qb-exact" | "sign" | "none"
    balance_gamma: float = 1e-3  # sign rule step size
    mtp_weight: float = 0.1
    gradient_checkpointing: bool = False
    fp8: bool = False  # projections as row-wise FP8 GEMMs (k3.ops.fp8.convert_to_float8_training)
    expert_parallel: bool = False  # under torchrun: a synonym of ep = WORLD (MoonEP over all ranks)
    # layout under torchrun (k3.parallel.mesh): world = pp·dp_shard·cp·ep
    dp_shard: int | None = None  # FSDP2 data-parallel degree (None: world / (ep·cp·pp))
    ep: int = 1  # MoonEP expert-parallel degree
    cp: int = 1  # context-parallel degree
    pp: int = 1  # pipeline stages
    # runtime
    device: str | None = None
    seed: int = 0
    out: str = "runs/k3-tiny"
    resume: bool = True  # continue from out/latest when present
    stop_after: int | None = None  # stop after this many steps (a time-boxed job); resume continues
    eval_every: int = 25
    eval_batches: int = 4
    sample_every: int = 100
    sample_tokens: int = 96
    sample_prompt: str = "def "
    save_every: int = 100
    keep_checkpoints: int = 2
    tensorboard: bool = True
    progress: bool = True

    def resolved(self) -> "TrainConfig":
        """A copy with preset-dependent defaults filled in and every value checked."""
        c = dataclasses.replace(self, data=list(self.data))
        seq, tps, lr = PRESET_DEFAULTS.get(c.preset, PRESET_DEFAULTS["k3-tiny"])
        c.seq_len = c.seq_len or seq
        c.tokens_per_step = c.tokens_per_step or (c.batch_size * c.seq_len if c.batch_size else tps)
        c.batch_size = c.batch_size or max(1, c.tokens_per_step // c.seq_len)
        c.lr = c.lr if c.lr is not None else lr
        c.validate()
        return c

    def validate(self) -> None:
        def pos(name):
            v = getattr(self, name)
            if v is None or v <= 0:
                raise ValueError(f"{name}={v!r}: expected a positive number")
        for n in ("seq_len", "batch_size", "tokens_per_step", "grad_accum", "steps", "lr", "eval_batches",
                  "sample_tokens", "keep_checkpoints"):
            pos(n)
        if self.optimizer not in ("muon", "adamw"):
            raise ValueError(f"optimizer={self.optimizer!r}: expected 'muon' or 'adamw'")
        if self.balance not in ("qb", "qb-exact", "sign", "none"):
            raise ValueError(f"balance={self.balance!r}: expected 'qb', 'qb-exact', 'sign' or 'none'")
        for n in ("min_lr_ratio", "long_context_frac"):
            if not 0 <= getattr(self, n) <= 1:
                raise ValueError(f"{n}={getattr(self, n)}: expected in [0, 1]")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac={self.warmup_frac}: expected in [0, 1)")
        for n in ("eval_every", "sample_every", "save_every", "weight_decay", "grad_clip", "qk_clip_tau",
                  "mtp_weight"):
            if getattr(self, n) < 0:
                raise ValueError(f"{n}={getattr(self, n)}: expected ≥ 0")
        for n in ("ep", "cp", "pp"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{n}={v!r}: expected an integer >= 1")
        if self.dp_shard is not None and (not isinstance(self.dp_shard, int) or self.dp_shard < 1):
            raise ValueError(f"dp_shard={self.dp_shard!r}: expected an integer >= 1 (or empty: world / (ep·cp·pp))")
        if self.stop_after is not None and self.stop_after <= 0:
            raise ValueError(f"stop_after={self.stop_after}: expected a positive step count")
        self.stages()  # parses the curriculum

    def stages(self) -> list[Stage]:
        """The context-length curriculum as steps → (seq_len, batch): tokens per step stay constant.

        "auto" mirrors K3's 8K → 64K → 256K → 1M (×1, ×8, ×32, ×128) scaled to the base length, keeping the
        stages whose rows still hold ≥ 1 sequence per micro-batch: 85 % of steps at ×1, then the longer
        stages share the rest (on k3-tiny's defaults: 256 then 2048 tokens)."""
        spec = self.curriculum
        if spec == "none":
            parts = [(1.0, 1)]
        elif spec == "auto":
            mults = [m for m in (8, 32, 128) if self.seq_len * m <= self.tokens_per_step]
            if not mults and self.seq_len * 2 <= self.tokens_per_step:
                mults = [self.tokens_per_step // self.seq_len]
            parts = [(0.85 if mults else 1.0, 1)] + [(0.15 / len(mults), m) for m in mults]
        else:
            try:
                parts = [(float(f), int(m)) for f, m in (p.split(":") for p in spec.split(","))]
            except ValueError:
                raise ValueError(f"curriculum={spec!r}: expected 'auto', 'none' or 'frac:mult,...' "
                                 "like '0.85:1,0.15:8'") from None
            if abs(sum(f for f, _ in parts) - 1) > 1e-6 or any(f <= 0 or m < 1 for f, m in parts):
                raise ValueError(f"curriculum={spec!r}: fractions must be > 0 and sum to 1, multipliers ≥ 1")
        stages, start = [], 0
        for i, (frac, mult) in enumerate(parts):
            L = self.seq_len * mult
            stages.append(Stage(start, L, max(1, self.tokens_per_step // L)))
            start += round(frac * self.steps) if i < len(parts) - 1 else 0
        return [s for i, s in enumerate(stages) if i == len(stages) - 1 or s.start < stages[i + 1].start]

    def layout(self, world: int):
        """The `ParallelDims` of this run on `world` ranks: `expert_parallel` means ep = world; dp_shard
        defaults to world / (ep·cp·pp). Raises ValueError naming the values that do not fit."""
        from ..parallel.mesh import ParallelDims
        ep = self.ep
        if self.expert_parallel:
            if world < 2:
                raise ValueError("expert_parallel needs several ranks: launch with torchrun --nproc_per_node=N")
            if ep not in (1, world):
                raise ValueError(f"expert_parallel (= ep {world}, the world size) conflicts with ep={ep}")
            ep = world
        rest = ep * self.cp * self.pp
        if self.dp_shard is None and world % rest:
            raise ValueError(f"ep·cp·pp = {ep}·{self.cp}·{self.pp} = {rest} must divide the world size {world} "
                             f"(dp_shard = world / (ep·cp·pp))")
        dims = ParallelDims(pp=self.pp, dp_shard=self.dp_shard or world // rest, cp=self.cp, ep=ep)
        if dims.world_size != world:
            raise ValueError(f"pp·dp_shard·cp·ep = {dims.pp}·{dims.dp_shard}·{dims.cp}·{dims.ep} = {dims.world_size} "
                             f"must equal the world size {world}" + (
                                 "; launch with torchrun --nproc_per_node=N" if world == 1 else ""))
        return dims

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_config_file(path: str | Path) -> dict:
    """Read a TOML (`.toml`) or YAML (`.yaml`/`.yml`) file of TrainConfig fields; unknown keys are errors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training config {str(path)!r} does not exist")
    if path.suffix == ".toml":
        import tomllib
        data = tomllib.loads(path.read_text())
    elif path.suffix in (".yaml", ".yml"):
        import yaml
        data = yaml.safe_load(path.read_text()) or {}
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
    else:
        raise ValueError(f"training config {str(path)!r}: expected a .toml, .yaml, .yml or .json file")
    if not isinstance(data, dict):
        raise ValueError(f"training config {str(path)!r}: expected a table of settings at the top level")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"training config {str(path)!r}: unknown setting(s) {', '.join(unknown)}; "
                         f"valid: {', '.join(sorted(known))}")
    return data
