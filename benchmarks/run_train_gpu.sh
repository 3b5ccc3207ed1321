#!/usr/bin/env bash
# The training-speed measurements of docs/benchmarks.md on one H200 (device kind nvidia-h200), in parts that each
# fit one 10-minute device call. Results (JSON, plots, logs) go to $OUT.
#   check  : the CUDA tests of the fused ops, the per-op benchmarks, one profiled k3-small step at 8 x 4096
#   tune   : launch-setting sweeps (AttnRes, short conv, flex attention), the optimizer's kernels, a profiled step
#   record : before (the session-start checkout in .base/, carried) and after in the same run: 2 x 4096 both,
#            then 8 x 4096 (profiled) and 16 x 4096 with activation checkpointing, and time / memory against T
# .base/ is `git archive <before-commit> | tar -x -C .base` (ignored by git, named in the call's carry).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
log() { echo "=== $* ($(date +%T))" | tee -a "$OUT/all.log"; }
log "GPU"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/all.log"
PART=${1:-check}
TT="python3 benchmarks/train_throughput.py --warmup 3 --steps 8"

if [ "$PART" = check ]; then
log "CUDA tests of the fused ops"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda --timeout 100 tests/test_linear_ce.py \
  tests/test_attn_res_fused.py tests/test_doc_attention.py tests/test_kda_layer_fast.py tests/test_moe_fast.py \
  tests/test_optim.py tests/test_cuda.py >"$OUT/tests.log" 2>&1 || echo "cuda tests exit $?" >>"$OUT/tests.log"
tail -5 "$OUT/tests.log" | tee -a "$OUT/all.log"
log "k3-small 8 x 4096, profiled"
timeout 150 $TT --batch 8 --profile --top 25 --label new --out "$OUT/train_8x4096.json" 2>&1 | tee -a "$OUT/all.log" \
  | tail -40
log "per-op benchmarks"
{ timeout 40 python3 benchmarks/attn_res.py --N 3 6 --reps 10 --out "$OUT/attn_res.json"
  timeout 40 python3 benchmarks/kda_layer.py --reps 10 --out "$OUT/kda_layer.json"
  timeout 40 python3 benchmarks/moe_layer.py --reps 10 --out "$OUT/moe_layer.json"
  timeout 50 python3 benchmarks/optim_step.py --reps 10 --out "$OUT/optim_step.json"; } >"$OUT/ops.log" 2>&1
elif [ "$PART" = tune ]; then
log "CUDA tests of the reworked kernels"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda --timeout 100 tests/test_attn_res_fused.py \
  tests/test_kda_layer_fast.py tests/test_moe_fast.py >"$OUT/tests.log" 2>&1 || echo "cuda tests exit $?" >>"$OUT/tests.log"
tail -4 "$OUT/tests.log" | tee -a "$OUT/all.log"
log "launch-setting sweeps: AttnRes, short conv backward, flex attention; optimizer kernels"
timeout 150 python3 benchmarks/attn_res.py --sweep --N 3 6 --reps 10 --out "$OUT/attn_res_sweep.json" >"$OUT/attn_sweep.log" 2>&1
grep -A12 -i "best\|LAUNCH" "$OUT/attn_sweep.log" | tail -30 | tee -a "$OUT/all.log"
timeout 100 python3 benchmarks/kda_layer.py --sweep --reps 10 --out "$OUT/kda_layer_sweep.json" >"$OUT/conv_sweep.log" 2>&1
tail -25 "$OUT/conv_sweep.log" | tee -a "$OUT/all.log"
timeout 130 python3 benchmarks/flex_sweep.py --reps 10 --out "$OUT/flex_sweep.json" 2>&1 | grep -v Warn | tee -a "$OUT/all.log"
timeout 60 python3 benchmarks/optim_step.py --impls fused --reps 10 --profile --out "$OUT/optim_step.json" 2>&1 \
  | grep -v Warn | tee -a "$OUT/all.log"
log "k3-small 8 x 4096, profiled"
timeout 120 $TT --batch 8 --profile --top 30 --label new --out "$OUT/train_8x4096.json" >"$OUT/train.log" 2>&1
tail -40 "$OUT/train.log" | tee -a "$OUT/all.log"
elif [ "$PART" = record ]; then
log "CUDA tests of the tuned launch settings (flex backward tiles, AttnRes, short conv)"
timeout 100 python3 -m pytest -q -p no:cacheprovider -m cuda --timeout 80 tests/test_doc_attention.py \
  tests/test_attn_res_fused.py -k "not every_sweep" >"$OUT/tests.log" 2>&1 || echo "cuda tests exit $?" >>"$OUT/tests.log"
tail -3 "$OUT/tests.log" | tee -a "$OUT/all.log"
log "before (session-start code): k3-small 2 x 4096"
( cd .base && export PYTHONPATH=$PWD && timeout 100 python3 benchmarks/train_throughput.py --batch 2 --warmup 2 \
    --steps 5 --backends triton --out "$OUT/before_2x4096.json" ) >"$OUT/before.log" 2>&1
tail -4 "$OUT/before.log" | tee -a "$OUT/all.log"
log "after: 2 x 4096, 8 x 4096 (profiled), 16 x 4096 with activation checkpointing"
timeout 60 $TT --batch 2 --label new --out "$OUT/after_2x4096.json" 2>&1 | tail -3 | tee -a "$OUT/all.log"
timeout 100 $TT --batch 8 --profile --top 30 --label new --out "$OUT/after_8x4096.json" >"$OUT/after_8.log" 2>&1
tail -37 "$OUT/after_8.log" | tee -a "$OUT/all.log"
timeout 100 $TT --batch 16 --grad-ckpt --label new --out "$OUT/after_16x4096_ckpt.json" 2>&1 | tail -3 \
  | tee -a "$OUT/all.log"
log "time and memory against T (one sequence, activation checkpointing)"
timeout 150 python3 benchmarks/seq_scaling.py --preset k3-small --lengths 8192,32768,131072 --grad-ckpt --warmup \
  --timeout 60 --out "$OUT/seq_gpu.json" --plot "$OUT/seq_gpu.png" 2>&1 | tee -a "$OUT/all.log"
fi
log "done"
