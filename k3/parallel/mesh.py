"""The training layout: sizes of the four parallel dimensions, their checks, and the `DeviceMesh` over them.

    dims = ParallelDims(pp=8, dp_shard=4, cp=1, ep=8)        # world = pp·dp_shard·cp·ep = 256
    dims.validate(world_size=256, config=cfg.text_config, seq_len=1 << 20)
    mesh = build_mesh(dims, "cuda")                         # under torchrun, after init_process_group
    mesh.ep.get_group()                                     # → enable_expert_parallel(model, group)

Mesh dimensions, outermost first (global rank = row-major index over (pp, dp_shard, cp, ep), so the EP
ranks of one expert group are adjacent, i.e. on one NVLink node when ep ≤ GPUs per node):
- `pp`: pipeline stages; stage s holds decoder layers `stage_layers(L, pp)[s]` (contiguous, sizes differ by ≤ 1).
- `dp_shard`: data parallel with FSDP2 sharding; every (dp_shard, ep) pair reads its own micro-batches.
- `cp`: context parallel: the ranks of one cp group hold one sequence, split into cp contiguous segments.
- `ep`: MoonEP expert parallel: rank e of an ep group owns experts [e·E/ep, (e+1)·E/ep) of every MoE layer
  of its stage; the ep ranks also read different batches (data parallel for every other parameter).

Derived (flattened) meshes: `fsdp` = (dp_shard, cp, ep), over which non-expert parameters are sharded and
their gradients reduced; `efsdp` = (dp_shard, cp), over which each rank's home experts are sharded;
`batch` = (dp_shard, ep), the data-parallel degree (distinct sequences per step).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DIMS = ("pp", "dp_shard", "cp", "ep")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh dimensions (each ≥ 1)."""

    pp: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"parallel size {f.name}={v!r} must be an integer >= 1")

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_shard, self.cp, self.ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_shard * self.cp * self.ep

    @property
    def batch_parallel(self) -> int:
        """Ranks of one pipeline stage that read distinct sequences: dp_shard·ep."""
        return self.dp_shard * self.ep

    @property
    def fsdp(self) -> int:
        """Ranks sharing (and sharding) one stage's non-expert parameters: dp_shard·cp·ep."""
        return self.dp_shard * self.cp * self.ep

    @property
    def efsdp(self) -> int:
        """Ranks sharing (and sharding) one rank's home experts: dp_shard·cp."""
        return self.dp_shard * self.cp

    def coordinate(self, rank: int) -> dict[str, int]:
        """{dim: index} of a global rank (row-major over pp, dp_shard, cp, ep: the same order as the mesh)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the layout's world of {self.world_size} ranks")
        out = {}
        for name, size in zip(reversed(DIMS), reversed(self.sizes)):
            out[name] = rank % size
            rank //= size
        return {d: out[d] for d in DIMS}

    def validate(self, world_size: int | None = None, config=None, seq_len: int | None = None,
                 global_batch: int | None = None) -> "ParallelDims":
        """Check the layout against a world size and a `K3TextConfig` (and optionally the sequence length and
        the global batch in sequences); raise ValueError naming the offending value. Returns self.

        - pp·dp_shard·cp·ep == world_size;
        - num_experts % ep == 0 (MoonEP: E/R home experts per rank);
        - pp ≤ num_hidden_layers (every stage holds ≥ 1 decoder layer);
        - seq_len % (2·cp) == 0: the causal load balance gives each cp rank two equal segments;
        - global_batch % (dp_shard·ep) == 0.
        KDA CP and MLA CP split the sequence, not the heads, so no head count has to divide cp.
        """
        if world_size is not None and self.world_size != world_size:
            raise ValueError(f"pp·dp_shard·cp·ep = {self.pp}·{self.dp_shard}·{self.cp}·{self.ep} = "
                             f"{self.world_size} must equal the world size {world_size}")
        if config is not None:
            E, L = config.num_experts, config.num_hidden_layers
            if E % self.ep:
                raise ValueError(f"ep={self.ep} must divide num_experts={E} (each EP rank owns E/ep experts)")
            if self.pp > L:
                raise ValueError(f"pp={self.pp} exceeds num_hidden_layers={L}: every stage needs a layer")
        if seq_len is not None and seq_len % (2 * self.cp):
            raise ValueError(f"seq_len={seq_len} must be divisible by 2·cp={2 * self.cp} (each cp rank takes two "
                             f"equal segments for the causal load balance)")
        if global_batch is not None and global_batch % self.batch_parallel:
            raise ValueError(f"global batch {global_batch} must be divisible by dp_shard·ep={self.batch_parallel}")
        return self


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous decoder-layer ranges of the pp stages, sizes differing by ≤ 1: the extra layers go to stages
    1, 2, … (stage 0 also holds the embedding and, under 1F1B, the most micro-batches in flight)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp={pp} must be between 1 and num_layers={num_layers}")
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if 1 <= s <= extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


@dataclass
class K3Mesh:
    """The 4-D `DeviceMesh` with its 1-D views and the flattened data-parallel meshes."""

    dims: ParallelDims
    mesh: object  # torch.distributed.device_mesh.DeviceMesh over DIMS
    fsdp: object  # (dp_shard, cp, ep) flattened
    efsdp: object  # (dp_shard, cp) flattened
    batch: object  # (dp_shard, ep) flattened

    def __getattr__(self, name):
        if name in DIMS:
            return self.mesh[name]
        raise AttributeError(name)


def build_mesh(dims: ParallelDims, device_type: str = "cpu", config=None, seq_len: int | None = None) -> K3Mesh:
    """Validate `dims` against the initialised process group's world size (and `config` / `seq_len` when
    given) and build the mesh (a collective: every rank calls it with the same arguments)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised process group (torchrun + init_process_group)")
    dims.validate(dist.get_world_size(), config, seq_len)
    mesh = init_device_mesh(device_type, dims.sizes, mesh_dim_names=DIMS)
    return K3Mesh(dims, mesh, mesh["dp_shard", "cp", "ep"]._flatten("fsdp"),
                  mesh["dp_shard", "cp"]._flatten("efsdp"), mesh["dp_shard", "ep"]._flatten("batch"))
