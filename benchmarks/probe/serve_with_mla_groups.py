"""`benchmarks/serve.py` with LAUNCH["groups"] of the MLA decode kernel set to the fastest setting that
`mla_decode_cfg.py` found (its JSON), when that beat the default by more than 10 %: the prefix hit's TTFT with
the candidate, in the same device call as the kernel sweep.

    python benchmarks/probe/serve_with_mla_groups.py mla_decode_cfg.json --out serve.json
"""
import json
import runpy
import sys
from pathlib import Path

from k3.ops.mla_decode import triton as mla

rows = json.loads(Path(sys.argv[1]).read_text())
tail = next(r for r in rows if "tail" in r)
best = tail["best"][0]
if best["us"] < 0.9 * tail["default"]["us"]:
    mla.LAUNCH["groups"].update(best["cfg"])
print(f"MLA groups launch: {mla.LAUNCH['groups']} (default {tail['default']['us']:.1f} us, best {best['us']:.1f})",
      flush=True)
sys.argv = [str(Path(__file__).resolve().parents[1] / "serve.py")] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
