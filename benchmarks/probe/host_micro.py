"""The host micro-costs the engine's hit and prefill paths were tuned by (session 23), on this machine: µs per call
(best of 5 × `--number` calls, `timeit`), hot caches. Run anywhere; no GPU.

- a 16K-id prompt list → the checked int64 array (`engine._valid_ids`, whose core is `array('Q', ids)`);
- an 8K-id prompt slice as a Python list (`array.tolist`) and into an int64 buffer from that list, against the
  array slice itself through the buffer protocol (`Sequence.input_ids`);
- the graphs' host tables: `token_runs_host` for a hit's 64-token tail (8 sequence slots), `prefill_tables_host`
  for an 8K chunk;
- `dataclasses.replace` of a SamplingParams (`Engine.generate`'s per-call copy).

    python benchmarks/probe/host_micro.py [--number 200] [--out host_micro.json]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import timeit
from array import array
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from k3.model.paged_cache import prefill_tables_host, token_runs_host  # noqa: E402
from k3.serve import SamplingParams  # noqa: E402
from k3.serve.engine import _valid_ids  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--out", default="host_micro.json")
    a = ap.parse_args()
    rng = random.Random(0)
    ids = [rng.randrange(160000) for _ in range(16448)]
    arr = array("q", ids)
    lst = arr[:8192].tolist()
    buf = np.zeros(8192, dtype=np.int64)
    N = 8192
    R = N // 16 + 2
    pre = [np.zeros(s, dtype=np.int32) for s in ((R, 2), (1,), (2,), (R + 1,), (N // 32, 2))]
    runs, first = np.zeros((64 // 16 + 8 + 1, 2), dtype=np.int32), np.zeros(8, dtype=np.int32)
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def assign_list():
        buf[:] = lst

    def assign_array():
        buf[:] = arr[:8192]

    cases = {
        "_valid_ids, 16,448 ids": lambda: _valid_ids(ids, 163840),
        "array('Q', ids), 16,448 ids": lambda: array("Q", ids),
        "array('q', ids), 16,448 ids": lambda: array("q", ids),
        "8,192-id array slice .tolist()": lambda: arr[:8192].tolist(),
        "8,192 ids into an int64 buffer from a list": assign_list,
        "8,192 ids into an int64 buffer from an array slice": assign_array,
        "token_runs_host, a hit's 64-token tail (8 slots)": lambda: token_runs_host([0, 64] + [64] * 7, 64, 16,
                                                                                    runs, first),
        "prefill_tables_host, an 8K chunk": lambda: prefill_tables_host(8000, [16, 32, 0, 0], N, *pre),
        "dataclasses.replace(SamplingParams)": lambda: replace(sp, output_kind="final_only"),
    }
    res = {}
    for name, fn in cases.items():
        res[name] = min(timeit.repeat(fn, number=a.number, repeat=5)) / a.number * 1e6
        print(f"{res[name]:9.2f} µs  {name}", flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
