#!/usr/bin/env bash
# Serving measurements on one H200: the CUDA tests of the engine's one forward and decode graphs, the decode
# profile, then benchmarks/serve.py (graphs vs eager decode in the same run). Results in $OUT.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -x -m cuda tests/test_decode_graphs.py \
  tests/test_paged_cache.py tests/test_serve_engine.py tests/test_attn_res_fused.py tests/test_moe_fast.py "tests/test_kda_triton.py" -k "not chunk or decode" > "$OUT/tests.log" 2>&1 \
  || echo "tests exit $?" >> "$OUT/tests.log"
tail -3 "$OUT/tests.log"
timeout ${PROF_S:-120} python3 benchmarks/probe/decode_profile.py --batch 1 32 256 --out "$OUT/decode_profile.json" \
  > "$OUT/profile.log" 2>&1 || echo "profile exit $?" >> "$OUT/profile.log"
cat "$OUT/profile.log" | head -60
timeout ${SERVE_S:-240} python3 benchmarks/serve.py --out "$OUT/serve.json" > "$OUT/serve.log" 2>&1 \
  || echo "serve exit $?" >> "$OUT/serve.log"
cat "$OUT/serve.log" | tail -20
