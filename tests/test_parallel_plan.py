"""`k3.parallel.mesh` (layout checks, rank coordinates, the DeviceMesh) and `k3.parallel.plan` (per-rank
memory/communication formulas), against measured values:
- the plan's tensor tables equal the model's parameters (shapes and optimizer kind) for k3-tiny, k3-small
  and the full k3 (meta device): exact;
- parameter elements per rank equal what FSDP2 (`fully_shard`) + MoonEP actually allocate on rank 0 of each
  pipeline stage's FSDP group, for 3 layouts of 8 ranks (a fake process group: no processes): exact;
- the activation estimate is within a factor 2 of the bytes the k3-tiny forward saves for backward (fp32, CPU);
- `k3 plan` prints a fitting layout for the full K3 on 256 and on 2,048 H200s (docs/parallel.md);
- bad layouts fail naming the value."""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from k3 import K3Config, K3ForConditionalGeneration
from k3.parallel.mesh import ParallelDims, stage_layers
from k3.parallel.plan import (PRECISIONS, layer_tensors, main, make_plan, parse_tokens, rank_param_elements,
                              stage_tensors)

ROOT = Path(__file__).resolve().parents[1]


def _text(preset: str):
    cfg = K3Config.preset(preset)
    cfg.vision_config = None
    return cfg


# ---- mesh ---------------------------------------------------------------------------------------
def test_layout_checks_name_the_value():
    c = _text("k3-tiny").text_config  # 8 experts, 5 layers
    with pytest.raises(ValueError, match="must equal the world size 6"):
        ParallelDims(pp=1, dp_shard=2, cp=1, ep=2).validate(world_size=6)
    with pytest.raises(ValueError, match="ep=3 must divide num_experts=8"):
        ParallelDims(ep=3).validate(config=c)
    with pytest.raises(ValueError, match="pp=6 exceeds num_hidden_layers=5"):
        ParallelDims(pp=6).validate(config=c)
    with pytest.raises(ValueError, match="seq_len=100 must be divisible by 2·cp=8"):
        ParallelDims(cp=4).validate(seq_len=100)
    with pytest.raises(ValueError, match="global batch 6 must be divisible by dp_shard·ep=4"):
        ParallelDims(dp_shard=2, ep=2).validate(global_batch=6)
    with pytest.raises(ValueError, match="cp=0 must be an integer >= 1"):
        ParallelDims(cp=0)
    with pytest.raises(ValueError, match="rank 8 is outside"):
        ParallelDims(dp_shard=2, ep=4).coordinate(8)
    assert ParallelDims(pp=2, dp_shard=2, cp=2, ep=2).validate(16, c, seq_len=64, global_batch=8).world_size == 16


def test_stage_layers_cover_every_layer_once():
    for L in (5, 16, 93):
        for pp in range(1, min(L, 12) + 1):
            st = stage_layers(L, pp)
            assert [i for r in st for i in r] == list(range(L))
            sizes = [len(r) for r in st]
            assert max(sizes) - min(sizes) <= 1 and sizes[0] == min(sizes)
    assert [len(r) for r in stage_layers(93, 8)] == [11, 12, 12, 12, 12, 12, 11, 11]


# ---- parameter tables and per-rank parameter bytes -------------------------------------------------
@pytest.mark.parametrize("preset", ["k3-tiny", "k3-small", "k3"])
def test_tensor_tables_match_the_model(preset):
    from k3.train.optim import classify_parameters

    cfg = _text(preset)
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg, init=False)
    kinds = classify_parameters(model)
    got = sorted((tuple(p.shape), "muon" if kinds[n][0] == "muon" else "adam") for n, p in model.named_parameters())
    want = sorted((tuple(s), "muon" if k in ("muon", "expert") else "adam")
                  for s, k in stage_tensors(cfg.text_config, 1, 0))
    assert got == want
    c = cfg.text_config
    for i, layer in enumerate(model.language_model.model.layers):  # per layer too (the stage split uses it)
        assert sorted(tuple(p.shape) for p in layer.parameters()) == sorted(tuple(s) for s, _ in layer_tensors(c, i))


_FSDP_SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from k3 import K3Config, K3ForConditionalGeneration
from k3.parallel.fsdp import apply_fsdp
from k3.parallel.mesh import ParallelDims, build_mesh, stage_layers
from k3.parallel.moonep import enable_expert_parallel
layouts = json.loads(sys.argv[1])
cfg = K3Config.preset("k3-tiny"); cfg.vision_config = None
L = cfg.text_config.num_hidden_layers
out = []
for sizes in layouts:
    dims = ParallelDims(*sizes)
    for rank in range(dims.world_size):
        co = dims.coordinate(rank)
        if co["dp_shard"] or co["cp"] or co["ep"]:
            continue  # rank 0 of its FSDP groups: holds the full (padded-size) dim-0 chunk
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
        mesh = build_mesh(dims, "cpu", cfg.text_config)
        assert dict(zip(("pp", "dp_shard", "cp", "ep"), mesh.mesh.get_coordinate())) == co
        with torch.device("meta"):
            model = K3ForConditionalGeneration(cfg, init=False)
        enable_expert_parallel(model, mesh.ep.get_group())
        apply_fsdp(model, mesh)
        st, pp = co["pp"], dims.pp
        mine = {f"language_model.model.layers.{i}." for i in stage_layers(L, pp)[st]}
        if st == pp - 1:
            mine |= {f"language_model.model.layers.{L + k}." for k in range(cfg.text_config.num_nextn_predict_layers)}
        def held(n):
            if n.startswith("language_model.model.layers."):
                return any(n.startswith(m) for m in mine)
            return (st == 0) if "embed_tokens" in n else (st == pp - 1)
        n = sum(p.to_local().numel() for name, p in model.named_parameters() if held(name))
        out.append([sizes, st, n])
        dist.destroy_process_group()
print(json.dumps(out))
"""


def test_param_elements_per_rank_equal_fsdp2_and_moonep_allocation():
    layouts = [(2, 2, 1, 2), (1, 1, 2, 4), (5, 1, 1, 8)]
    r = subprocess.run([sys.executable, "-c", _FSDP_SCRIPT, json.dumps(layouts)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    measured = json.loads(r.stdout.strip().splitlines()[-1])
    c = _text("k3-tiny").text_config
    assert len(measured) == sum(s[0] for s in layouts)  # every stage of every layout
    for sizes, stage, n in measured:
        dims = ParallelDims(*sizes)
        assert rank_param_elements(c, dims, stage) == n, (sizes, stage)
    # the plan reports the heaviest stage, in bytes (fp32: 4 per element; bf16: 2)
    dims = ParallelDims(2, 2, 1, 2)
    heaviest = max(n for sizes, _, n in measured if tuple(sizes) == dims.sizes)
    for prec, (pb, _, _) in PRECISIONS.items():
        plan = make_plan(c, dims, seq=64, precision=prec, gradient_checkpointing=True, device_bytes=1e30)
        assert plan.param_bytes in {pb * rank_param_elements(c, dims, s) for s in range(dims.pp)}
        assert plan.param_bytes <= pb * heaviest


# ---- activations --------------------------------------------------------------------------------
def test_activation_estimate_within_factor_two_of_saved_bytes(one_thread):
    """Bytes of the distinct storages the k3-tiny training forward (fp32, CPU, fused CE head) keeps for
    backward at T = 2048, against `activation_bytes` (act_bytes=4). The CPU torch KDA path checkpoints
    its segments, as the GPU kernels recompute; factor 2 either way is the stated tolerance."""
    cfg = _text("k3-tiny")
    torch.manual_seed(0)
    model = K3ForConditionalGeneration(cfg).train()
    T = 2048
    ids = torch.randint(0, cfg.text_config.vocab_size - 100, (1, T), generator=torch.Generator().manual_seed(1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    refs = []

    def pack(t):
        refs.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels=ids)
    live = {}
    for r in refs:
        t = r()
        if t is not None and t.untyped_storage().data_ptr() not in params:
            live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    measured = sum(live.values())
    est = make_plan(cfg.text_config, ParallelDims(), T, act_bytes=4).activation_bytes
    assert out.logits is None  # the fused head: no [T, V] logits, as the plan assumes by default
    assert 0.5 <= est / measured <= 2.0, (est, measured)
    ck = make_plan(cfg.text_config, ParallelDims(), T, act_bytes=4, gradient_checkpointing=True).activation_bytes
    assert ck < est


# ---- CLI and the documented layouts -------------------------------------------------------------
def test_cli_documented_layouts_fit(capsys):
    assert main(["--preset", "k3", "--gpus", "256", "--seq", "32K", "--cp", "8", "--ep", "32",
                 "--precision", "bf16", "--checkpointing"]) == 0
    out256 = capsys.readouterr().out
    assert "fits in 141 GB: yes" in out256 and "pp 1 × dp_shard 1 × cp 8 × ep 32" in out256
    assert main(["--preset", "k3", "--gpus", "2048", "--seq", "1M", "--cp", "128", "--ep", "16",
                 "--checkpointing"]) == 0
    out2k = capsys.readouterr().out
    assert "fits in 141 GB: yes" in out2k and "seq 1048576" in out2k
    assert main(["--preset", "k3", "--gpus", "256", "--seq", "1M", "--pp", "8", "--ep", "32", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["fits"] is False and js["pp"] == 8 and js["stage_layers"] == [11, 12, 12, 12, 12, 12, 11, 11]


def test_cli_errors_name_the_value():
    with pytest.raises(ValueError, match="--gpus 100 is not divisible by pp·cp·ep = 64"):
        main(["--preset", "k3", "--gpus", "100", "--ep", "64"])
    with pytest.raises(ValueError, match="ep=6 must divide num_experts=896"):
        main(["--preset", "k3", "--gpus", "6", "--ep", "6"])
    with pytest.raises(ValueError, match="precision='fp8'"):
        make_plan(_text("k3-tiny").text_config, ParallelDims(), 64, precision="fp8")
    with pytest.raises(ValueError, match="sequence length '1Q'"):
        parse_tokens("1Q")
    assert parse_tokens("1M") == 1 << 20 and parse_tokens("128k") == 131072 and parse_tokens("4096") == 4096
