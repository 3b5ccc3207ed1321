"""benchmarks/probe/trace_breakdown.py on a synthetic Chrome trace: GPU time by phase and where the GPU idles."""
import gzip
import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "trace_breakdown", Path(__file__).resolve().parents[1] / "benchmarks" / "probe" / "trace_breakdown.py")
tb = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tb)


def _trace():
    """Two phases on one host thread; kernels on a GPU stream. Timestamps in µs. Gaps between kernels: 100 µs
    before the add (forward), 5 µs before the second mm (forward, under the 10 µs bar), 1,000 µs before the
    backward's mm, and none inside two overlapping kernels (two streams)."""
    ev = [dict(ph="X", cat="user_annotation", name="phase:forward", ts=0, dur=1000, tid=1, pid=1),
          dict(ph="X", cat="user_annotation", name="phase:backward", ts=1000, dur=1000, tid=1, pid=1)]
    kernels = [  # (op, its launch time, kernel start, kernel duration)
        ("aten::mm", 10, 20, 30),       # busy 20-50
        ("aten::add", 140, 150, 10),    # gap 50 -> 150: 100 µs, ended by the add
        ("aten::mm", 162, 165, 40),     # gap 160 -> 165: 5 µs, not counted
        ("aten::mul", 170, 205, 100),   # starts when the mm ends: busy 205-305
        ("aten::copy_", 180, 210, 20),  # overlaps the mul (another stream): no gap
        ("aten::mm", 1100, 1305, 30),   # gap 305 -> 1305: 1,000 µs, launched in the backward phase
    ]
    for corr, (op, launch, start, dur) in enumerate(kernels):
        ev.append(dict(ph="X", cat="cpu_op", name=op, ts=launch - 1, dur=5, tid=1, pid=1,
                       args={"Input Dims": [[4, 4]]}))
        ev.append(dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=launch, dur=2, tid=1, pid=1,
                       args={"correlation": corr}))
        ev.append(dict(ph="X", cat="kernel", name=f"k_{op}", ts=start, dur=dur, tid=7, pid=0,
                       args={"correlation": corr}))
    return ev


@pytest.mark.parametrize("gz", [False, True])
def test_idle_gaps_by_phase_and_by_the_op_that_ended_them(tmp_path, capsys, monkeypatch, gz):
    path = tmp_path / ("t.json.gz" if gz else "t.json")
    data = json.dumps({"traceEvents": _trace()})
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)
    monkeypatch.setattr("sys.argv", ["trace_breakdown.py", str(path), "--gap", "10"])
    tb.main()
    out = capsys.readouterr().out
    assert "GPU busy 0.2 ms over a 1.3 ms span, 6 GPU events" in out  # 30+10+40+100+20+30 = 230 µs; 20 -> 1,335
    idle = out[out.index("GPU idle"):]
    assert "GPU idle in gaps over 10 µs: 1.1 ms" in idle  # 100 + 1,000 µs; the 5 µs gap is under the bar
    lines = [ln.split() for ln in idle.splitlines()]
    assert ["backward", "1.0", "ms"] in lines and ["forward", "0.1", "ms"] in lines
    assert ["1.00", "1", "backward", "aten::mm", "aten::mm"] in lines
    assert ["0.10", "1", "forward", "aten::add", "aten::add"] in lines
    assert not any("aten::copy_" in ln or "aten::mul" in ln for ln in idle.splitlines())


def test_idle_gaps_threshold_and_overlap():
    gpu = [dict(ts=0, dur=10), dict(ts=5, dur=20), dict(ts=40, dur=1), dict(ts=43, dur=1)]  # busy 0-25, 40-41, 43-44
    phase = lambda i: "p"  # noqa: E731
    by_phase, by_op = tb.idle_gaps(gpu, {}, phase, 1.0)
    assert by_phase["p"] == pytest.approx((15 + 2) / 1e3)
    assert by_op[("p", "-", "-")] == [pytest.approx(0.017), 2]
    by_phase, _ = tb.idle_gaps(gpu, {}, phase, 2.0)  # the 2 µs gap is not over the bar
    assert by_phase["p"] == pytest.approx(0.015)


def test_kinds_of_work():
    """Each GPU event goes to one kind: the optimizer phase first, then copies, attention, GEMMs (the fused CE's
    are the vocabulary heads'), KDA, elementwise, the rest."""
    k = tb.kind_of
    assert k("nvjet_sm90_tst_320x128", "forward", "_LinearCrossEntropy", "aten::mm") == "vocabulary head GEMMs"
    assert k("nvjet_sm90_tst_192x192", "backward", "autograd::engine::evaluate_function: MmBackward0",
             "aten::mm") == "other GEMMs"
    assert k("_ZN7cutlass13device_kernel", "forward", "aten::_grouped_mm", "aten::_grouped_mm") == "other GEMMs"
    assert k("nvjet_sm90_tst_256x128", "optimizer", "aten::bmm", "aten::bmm") == "optimizer"
    assert k("void pytorch_flash::flash_fwd_kernel", "forward", "torch_attn::_varlen_attn",
             "aten::_flash_attention_forward") == "attention"
    assert k("kda_intra_bwd_kernel", "backward", "x", "_ChunkKDABackward") == "KDA kernels"
    assert k("void at::native::vectorized_elementwise_kernel", "backward", "x", "aten::add_") == \
        "elementwise kernels"
    assert k("Memcpy DtoD (Device -> Device)", "backward", "x", "aten::copy_") == "copies and fills"
    assert k("rms_norm_bwd_kernel", "backward", "x", "_RMSNormBackward") == "other kernels"
    assert set(tb.KINDS) >= {"vocabulary head GEMMs", "other kernels", "optimizer"}


def test_main_prints_the_kinds(tmp_path, capsys, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    monkeypatch.setattr("sys.argv", ["trace_breakdown.py", str(path)])
    tb.main()
    out = capsys.readouterr().out
    kinds = out[out.index("by kind of work"):out.index("top kernels")]
    # the synthetic kernels are named k_<op>: the three mm launches are GEMMs by their op, the rest other kernels
    rows = {ln[:25].strip(): ln.split()[-2:] for ln in kinds.splitlines()[1:] if ln.strip()}
    assert rows["other GEMMs"] == ["0.1", "3"]  # 30 + 40 + 30 µs
    assert rows["other kernels"] == ["0.1", "3"]  # the add, the mul, the copy_: 10 + 100 + 20 µs
