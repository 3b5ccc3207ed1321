#!/usr/bin/env bash
# KDA kernel measurements on the lent H200s (device kind nvidia-h200-x2): GPU1 times fla 0.6.0 (autotuning
# once; its autotune results are kept in $OUT/tcache and reused from .tcache_fla/ when carried back) and GPU0
# profiles ours (per-kernel breakdown, launch variants, Nsight Compute sections of each kernel).
#   bash benchmarks/run_kda_gpu.sh final|cp|tune|profile|bench|ab   (final: the record run; cp: the 2-GPU CP test;
#   tune / profile: launch variants, ncu; ab: this tree against .old.tar)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"; OUTA=$(cd "$OUT" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && if [ -f .tcache_fla/tcache.tgz ]; then tar xzf .tcache_fla/tcache.tgz -C /tmp/tc; fi
PART=${1:-profile}
VARIANTS=${VARIANTS:-'[{"intra_warps": 8}, {"intra_warps": 2}, {"fwd_bv": 32}, {"save_states": true}]'}
keep_tune() { (cd /tmp/tc && find . -name '*.autotune.json' | tar czf "$OUT/tcache${1:+_$1}.tgz" -T -); }  # [suffix]
if [ "$PART" = final ]; then
# GPU0: (a), (d), (b) against fla, also with states kept (ours save_states vs fla disable_recompute), optionally after a
# short sweep of the backward's launch settings at (a) (SWEEP=1); GPU1: the kernel tests, decode (e) unless NODECODE=1,
# then (c) against fla (fla autotunes H12 unless cached). fla's autotune results come back in tcache_{0,1}.tgz.
( export CUDA_VISIBLE_DEVICES=0
  K3_KDA_SWEEP=short timeout 540 python3 benchmarks/kda.py ${SWEEP:+--sweep} --shapes adb --fla all --keep-states \
    --fla-budget-s 420 --deadline-s 500 --warmup 3 --reps 20 --out $OUT/kda.json > $OUT/bench.log 2>&1; keep_tune 0
  timeout 40 python3 benchmarks/kda_profile.py --impl ours --cpu --out $OUT/prof_ours.json > $OUT/prof.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  PYTHONPATH=$PWD timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 110 tests/test_kda_triton.py \
      > $OUT/tests.log 2>&1 || echo "exit $?" >> $OUT/tests.log
  [ -n "${NODECODE:-}" ] || timeout 80 python3 benchmarks/kda.py --shapes e --fla decode --reps 20 \
      --out $OUT/kda_decode.json > $OUT/decode.log 2>&1
  timeout 330 python3 benchmarks/kda.py --shapes c --fla all --keep-states --split 0 --fla-budget-s 280 \
    --deadline-s 320 --reps 20 --out $OUT/kda_c.json > $OUT/c.log 2>&1; keep_tune 1 ) &
wait
elif [ "$PART" = cp ]; then
# the 2-GPU NCCL context-parallel test (op and layer against one GPU)
PYTHONPATH=$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda -s --timeout 280 tests/test_kda_cp.py \
  > $OUT/tests_cp.log 2>&1 || echo "cp tests exit $?" >> $OUT/tests_cp.log
elif [ "$PART" = ab ]; then
# this tree against the tree in .old.tar (git archive of an earlier commit, carried): per-kernel profiles at (a)
# on GPU1 and GPU0, launch variants, the recurrence alone at 16/32/64-token steps, and (c), (d) with splitting.
FWDV=${FWDV:-'[{"fwd_chunk": 32}, {"fwd_warps": 8}, {"prefetch": false}, {"fwd_chunk": 32, "prefetch": false}, {"fwd_chunk": 32, "fwd_warps": 8}]'}
BWDV=${BWDV:-'[{"bwd_warps": 8}, {"store_warps": 8}, {"bwd_prefetch": false}, {"save_states": true}, {"save_states": true, "bwd_warps": 8, "store_warps": 8}]'}
STEPS=${STEPS:-'[{"BT": 16}, {"BT": 32}, {"BT": 32, "prefetch": false}, {"BT": 32, "fwd_warps": 8}, {"BT": 64, "prefetch": false}, {"BT": 64, "prefetch": false, "fwd_warps": 8}, {"BT": 16, "fwd_bv": 32}]'}
( export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD
  timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 140 tests/test_kda_triton.py > $OUT/tests.log 2>&1 \
    || echo "tests exit $?" >> $OUT/tests.log
  timeout 150 python3 benchmarks/kda_profile.py --impl ours --fwd-only --cpu --variants "$FWDV" --out $OUT/prof_fwd.json > $OUT/prof_fwd.log 2>&1
  timeout 150 python3 benchmarks/kda_profile.py --impl ours --variants "$BWDV" --out $OUT/prof_new.json > $OUT/prof_new.log 2>&1
  timeout 60 python3 benchmarks/kda_profile.py --recur-steps "$STEPS" --out $OUT/steps.json > $OUT/steps.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  mkdir -p /tmp/old && tar xf .old.tar -C /tmp/old
  (cd /tmp/old && PYTHONPATH=/tmp/old timeout 120 python3 benchmarks/kda_profile.py --impl ours \
     --variants '[{"fwd_chunk": 32}]' --out $OUTA/prof_old.json > $OUTA/prof_old.log 2>&1)
  PYTHONPATH=$PWD timeout 240 python3 benchmarks/kda.py --shapes bcd --fla none --split ${SPLITS:-0,4} --keep-states \
    --reps 10 --out $OUT/kda_split.json > $OUT/split.log 2>&1 ) &
wait
elif [ "$PART" = tune ]; then
( CUDA_VISIBLE_DEVICES=1 timeout 560 python3 benchmarks/kda.py --shapes abcd --fla all --fla-budget-s 530 \
    --deadline-s 540 --reps 10 --out $OUT/kda_all.json > $OUT/fla.log 2>&1; keep_tune ) &
( export CUDA_VISIBLE_DEVICES=0
  PYTHONPATH=$PWD timeout 240 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/test_kda_triton.py \
    > $OUT/tests.log 2>&1 || echo "tests exit $?" >> $OUT/tests.log
  timeout 300 python3 benchmarks/kda_profile.py --impl ours --variants "$VARIANTS" --out $OUT/prof_ours.json > $OUT/ours.log 2>&1 ) &
wait
elif [ "$PART" = profile ]; then
( CUDA_VISIBLE_DEVICES=1 timeout 560 bash -c "
    python3 benchmarks/kda_profile.py --impl fla --out $OUT/prof_fla.json > $OUT/fla.log 2>&1
    python3 benchmarks/kda.py --shapes abcd --fla all --fla-budget-s 420 --deadline-s 430 --reps 20 \
      --out $OUT/kda_all.json >> $OUT/fla.log 2>&1" ; keep_tune ) &
( export CUDA_VISIBLE_DEVICES=0
  timeout 200 python3 benchmarks/kda_profile.py --impl ours --variants "$VARIANTS" --out $OUT/prof_ours.json > $OUT/ours.log 2>&1
  timeout 200 ncu --clock-control none -k regex:kda_ -c 6 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 -c "
import torch, sys; sys.path.insert(0, 'benchmarks')
from kda import make_inputs, ours_fn
x = make_inputs(1, 8192, 96, 128, 'cuda', torch.bfloat16, 1)
f, b = ours_fn(x, None, True); b(f()); torch.cuda.synchronize()" > $OUT/ncu.log 2>&1 || echo "ncu exit $?" >> $OUT/ncu.log
  ) &
wait
else
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 benchmarks/kda.py --shapes abcde --fla all --fla-budget-s 500 \
    --reps 20 --out "$OUT/kda.json" > "$OUT/bench.log" 2>&1; keep_tune
fi
