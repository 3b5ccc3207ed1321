#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md on 2 H200s (device kind nvidia-h200-x2), in two parts that each
# fit one 10-minute call: `dist` (MoonEP EP=2, KDA context parallel CP=2, multi-GPU tests) and `single`
# (k3-small training throughput on GPU0 and serving on GPU1, in parallel; one-GPU CUDA tests).
# The serving run leaves fla out (KDA prefill/decode on our Triton kernels, no fla autotuning in the timings).
# Results (JSON, plot, logs) go to $OUT. Run from the repo root with the fla-core wheel in .whl/.
# NVLink multicast stays off.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
log() { echo "=== $* ($(date +%T))" | tee -a "$OUT/all.log"; }
log "GPUs"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/all.log"

PART=${1:-dist}
if [ "$PART" = dist ]; then
log "MoonEP vs naive all-to-all, EP=2"
timeout 240 torchrun --nproc_per_node=2 benchmarks/moonep.py --out "$OUT/moonep.json" --plot "$OUT/moonep.png" \
  >>"$OUT/all.log" 2>&1 || echo "moonep exit $?" | tee -a "$OUT/all.log"

log "KDA context parallel, CP=2 vs CP=1"
timeout 150 torchrun --nproc_per_node=2 benchmarks/kda_cp.py --backend triton --reps 10 --out "$OUT/kda_cp.json" \
  >>"$OUT/all.log" 2>&1 || echo "kda_cp exit $?" | tee -a "$OUT/all.log"

log "two-GPU and one-GPU CUDA tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda --timeout 60 tests/test_kda_cp.py \
  tests/test_moonep_planner.py tests/test_moonep_dist.py >"$OUT/tests.log" 2>&1 || echo "cuda tests exit $?" >>"$OUT/tests.log"
elif [ "$PART" = profile ]; then
log "k3-small training step profile (GPU0, Triton KDA) and CUDA tests without fla (GPU1; fla autotuning would dominate)"
( CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/train_throughput.py --batch 2 --seq-len 4096 --warmup 2 \
    --steps 3 --backends triton --profile --out "$OUT/train_profile.json" >"$OUT/profile.log" 2>&1 \
    || echo "profile exit $?" >>"$OUT/profile.log" ) &
( CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda --timeout 60 \
    tests/ --ignore=tests/test_env_api.py --ignore=tests/test_serve_api.py --ignore=tests/test_kda_cp.py \
    --ignore=tests/test_moonep_dist.py >"$OUT/tests.log" 2>&1 || echo "cuda tests exit $?" >>"$OUT/tests.log" ) &
wait
else

log "k3-small training throughput (GPU0) and serving (GPU1), in parallel"
( CUDA_VISIBLE_DEVICES=0 timeout 260 python3 benchmarks/train_throughput.py --batch 2 --seq-len 4096 \
    --warmup 2 --steps 6 --backends triton,torch,fla --out "$OUT/train.json" >"$OUT/train.log" 2>&1 || echo "train exit $?" >>"$OUT/train.log" ) &
( CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD timeout 260 python3 benchmarks/serve.py --out "$OUT/serve.json" >"$OUT/serve.log" 2>&1 \
    || echo "serve exit $?" >>"$OUT/serve.log" ) &
wait
cat "$OUT/train.log" "$OUT/serve.log" >>"$OUT/all.log"
rm -f "$OUT/train.log" "$OUT/serve.log"
log "CUDA tests (one and two GPUs), 60 s per test"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m cuda --timeout 60 tests/ --ignore=tests/test_env_api.py \
  --ignore=tests/test_serve_api.py >"$OUT/tests.log" 2>&1 \
  || echo "cuda tests exit $?" >>"$OUT/tests.log"
fi
log "done"
