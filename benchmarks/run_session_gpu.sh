#!/usr/bin/env bash
# One device call (≤ 10 min) of this session's GPU measurements, results in $OUT:
#   1. the CUDA tests touched by the change (KDA states_at, paged cache, engine, decode graphs);
#   2. benchmarks/probe/prefill_profile.py (forwards, GPU time, syncs and host hot spots of a prefill; PREFILL=0
#      skips it) and benchmarks/probe/decode_profile.py (GPU time and kernels of a decode step; DECODE=1, KDC=0 skips
#      the KDA decode launch probe after it);
#   2b. benchmarks/probe/decode_ops.py (every op of a decode forward by source line, graph launch cost; OPS=1);
#       benchmarks/probe/kda_extend.py (the KDA extend step token by token vs in 16-token tiles; KEXT=1);
#       benchmarks/probe/prefill_kernels.py (the prefill's KDA recurrence and conv launch settings; PK=1);
#       benchmarks/probe/gemv.py (decode projections: cuBLAS vs the GEMV kernel; GEMV=1, GEMV_ROWS="32 64" for
#       the wide tiles);
#       benchmarks/probe/moe_tiles.py (MoE expert tiles vs the grouped GEMMs, 16-1,024 tokens; MOET=1);
#       benchmarks/probe/graph_launch.py (a prefix hit's host phases, graph launch host time; GL=1);
#       benchmarks/probe/mla_decode_cfg.py (the MLA decode kernel's launch settings; MLACFG=1);
#       benchmarks/probe/hit_pattern.py (a prefix hit's phases and timeline by its place in a round; HP=1,
#       HP_ARGS=--cprofile: and its Python by function, --trace: its timeline of engine calls);
#       benchmarks/probe/hit_switches.py (a 16K hit under every combination of its switches, interleaved; HS=1);
#       benchmarks/probe/moe_fused.py (the one-kernel routed experts experiment; MF=1);
#       benchmarks/probe/kda_small.py (short extend steps' KDA / conv settings, intra up to 32K tokens; KS=1);
#       benchmarks/probe/persistent_chain.py (96 decode GEMVs: graph kernels, one persistent kernel with grid
#       barriers, its L2 prefetch ahead; PC=1, PC_ARGS for its options);
#       benchmarks/probe/graph_branches.py (independent GEMVs of a layer side by side in the graph; GB=1);
#       benchmarks/probe/moe_block.py (a batch-1 MoE as one persistent kernel or four launches vs the composed path;
#       MB=1, MB_ARGS=--split-only);
#       benchmarks/kda_profile.py at the training shape 8 x 4096, H 12: the KDA kernels' launch settings, the
#       column-block intra backward's among them (benchmarks/kda_train_variants.json; KIB=1);
#       benchmarks/joined_proj.py (a KDA / MLA / MoE layer's training step, projections joined and separate; JP=1);
#       benchmarks/fp8_linear.py (FP8 projections vs bf16: each shape, the quantisation kernel, whole layers; FP8L=1);
#       benchmarks/probe/mla_train_attn.py (training attention: flex vs FlashAttention varlen, the max-logit kernel;
#       ATT=1);
#   3. benchmarks/serve.py (decode, prefill, TTFT, engine vs generate);
#   4. benchmarks/train_throughput.py at 8 x 4096, plain, under TRAIN_ENV's switches and with regional torch.compile,
#      in the same run; TRACE=1 then profiles one plain step and prints probe/trace_breakdown.py's GPU time by phase
#      and op, and where the GPU idles (TRACE_ARGS, e.g. "--top 30 --gap 10").
# At most 8 files come back from one device call: with many steps on, delete the probes' JSON from $OUT at the end.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
if [ "${TESTS:-1}" = 1 ]; then
  # TEST_M: the marker filter ("cuda" by default; "" also runs the device-agnostic tests, which take CUDA when
  # present); TEST_FILES: the files (default: the serving and kernel files below)
  FILES=${TEST_FILES:-"tests/test_kda_triton.py tests/test_paged_cache.py tests/test_serve_engine.py
    tests/test_decode_graphs.py tests/test_extend_graphs.py tests/test_serve_async.py tests/test_mla_decode.py
    tests/test_moe_fast.py tests/test_attn_res_fused.py tests/test_compile.py tests/test_gemv.py
    tests/test_greedy_kernel.py tests/test_prefill_graphs.py"}
  timeout ${TEST_S:-300} python3 -m pytest -q -rf --tb=line -p no:cacheprovider -m "${TEST_M-cuda}" \
    -k "${TEST_K:-not nothing}" $FILES > "$OUT/tests.log" 2>&1 || echo "tests exit $?" >> "$OUT/tests.log"
  tail -3 "$OUT/tests.log"
fi
if [ "${PREFILL:-1}" = 1 ]; then
  # K3_PDL=0: kernels' profiled durations without the early start of programmatic dependent launch (PROF_PDL=1: on)
  K3_PDL=${PROF_PDL:-0} timeout ${PROF_S:-80} python3 benchmarks/probe/prefill_profile.py --out "$OUT/prefill_profile.json" \
    > "$OUT/prefill.log" 2>&1 \
    || echo "prefill profile exit $?" >> "$OUT/prefill.log"
  grep "==" "$OUT/prefill.log"
fi
if [ "${DECODE:-0}" = 1 ]; then
  timeout ${DEC_S:-120} python3 benchmarks/probe/decode_profile.py --batch ${DEC_BATCH:-1 256} --out "$OUT/decode_profile.json" \
    > "$OUT/decode.log" 2>&1 || echo "decode profile exit $?" >> "$OUT/decode.log"
  grep -E "batch|copy_" "$OUT/decode.log"
  if [ "${KDC:-1}" = 1 ]; then  # the KDA decode kernel's launch settings
    timeout 60 python3 benchmarks/probe/kda_decode_cfg.py --out "$OUT/kda_decode_cfg.json" > "$OUT/kda_decode_cfg.log" 2>&1
    cat "$OUT/kda_decode_cfg.log" | tail -34
  fi
fi
if [ "${KEXT:-0}" = 1 ]; then  # the KDA extend step token by token vs in 16-token tiles
  timeout ${KEXT_S:-90} python3 benchmarks/probe/kda_extend.py --out "$OUT/kda_extend.json" > "$OUT/kda_extend.log" 2>&1 \
    || echo "kda extend exit $?" >> "$OUT/kda_extend.log"
  grep -E "^n |exit|Error" "$OUT/kda_extend.log"
fi
if [ "${PK:-0}" = 1 ]; then  # launch settings of the prefill's KDA recurrence and short conv
  timeout ${PK_S:-90} python3 benchmarks/probe/prefill_kernels.py --out "$OUT/prefill_kernels.json" \
    > "$OUT/prefill_kernels.log" 2>&1 || echo "prefill kernels exit $?" >> "$OUT/prefill_kernels.log"
  tail -22 "$OUT/prefill_kernels.log"
fi
if [ "${GEMV:-0}" = 1 ]; then  # the decode projections: cuBLAS vs the GEMV kernel's launch settings
  timeout ${GEMV_S:-120} python3 benchmarks/probe/gemv.py --rows ${GEMV_ROWS:-1 4 16} --out "$OUT/gemv.json" \
    > "$OUT/gemv.log" 2>&1 \
    || echo "gemv exit $?" >> "$OUT/gemv.log"
  cat "$OUT/gemv.log" | tail -45
fi
if [ "${KIB:-0}" = 1 ]; then  # the KDA kernels' training launch settings (benchmarks/kda_train_variants.json)
  timeout ${KIB_S:-420} python3 benchmarks/kda_profile.py --shape 8x4096x12 \
    --variants "$(cat ${KIB_VARIANTS:-benchmarks/kda_train_variants.json})" --focus kda_ \
    --out "$OUT/kda_train_cfg.json" > "$OUT/kda_train_cfg.log" 2>&1 || echo "kda train cfg exit $?" >> "$OUT/kda_train_cfg.log"
  grep -E "^==|exit|Error" "$OUT/kda_train_cfg.log"
fi
if [ "${JP:-0}" = 1 ]; then  # one KDA / MLA / MoE layer's forward + backward with joined and separate projections
  timeout ${JP_S:-150} python3 benchmarks/joined_proj.py --out "$OUT/joined_proj.json" > "$OUT/joined_proj.log" 2>&1 \
    || echo "joined proj exit $?" >> "$OUT/joined_proj.log"
  grep -E "^(kda|mla|moe):|exit|Error" "$OUT/joined_proj.log"
fi
if [ "${FP8L:-0}" = 1 ]; then  # FP8 projections vs bf16 (k3.ops.fp8): each shape, the quantisation, whole layers
  timeout ${FP8L_S:-200} python3 benchmarks/fp8_linear.py ${FP8L_ARGS:-} --out "$OUT/fp8_linear.json" > "$OUT/fp8_linear.log" \
    2>&1 || echo "fp8 linear exit $?" >> "$OUT/fp8_linear.log"
  grep -v Warn "$OUT/fp8_linear.log" | tail -22
fi
if [ "${ATT:-0}" = 1 ]; then  # training attention: flex against PyTorch's FlashAttention (varlen), the max logit
  timeout ${ATT_S:-120} python3 benchmarks/probe/mla_train_attn.py --out "$OUT/mla_train_attn.json" \
    > "$OUT/mla_train_attn.log" 2>&1 || echo "mla train attn exit $?" >> "$OUT/mla_train_attn.log"
  grep -v -i warn "$OUT/mla_train_attn.log" | tail -5
fi
if [ "${MOET:-0}" = 1 ]; then  # MoE expert tiles vs the grouped GEMMs, and their launch settings
  timeout ${MOET_S:-150} python3 benchmarks/probe/moe_tiles.py --out "$OUT/moe_tiles.json" > "$OUT/moe_tiles.log" 2>&1 \
    || echo "moe tiles exit $?" >> "$OUT/moe_tiles.log"
  grep -v "^   " "$OUT/moe_tiles.log" | tail -20
fi
if [ "${GL:-0}" = 1 ]; then  # a prefix hit's host phases without the profiler; graph launch host time
  timeout ${GL_S:-200} python3 benchmarks/probe/graph_launch.py --out "$OUT/graph_launch.json" > "$OUT/graph_launch.log" \
    2>&1 || echo "graph launch exit $?" >> "$OUT/graph_launch.log"
  grep -v Warn "$OUT/graph_launch.log" | tail -25
fi
if [ "${MLACFG:-0}" = 1 ]; then  # the MLA decode kernel's launch settings (MLACFG_PARTS: decode and / or groups)
  timeout ${MLACFG_S:-150} python3 benchmarks/probe/mla_decode_cfg.py --parts ${MLACFG_PARTS:-decode groups} \
    --out "$OUT/mla_decode_cfg.json" > "$OUT/mla_decode_cfg.log" 2>&1 || echo "mla cfg exit $?" >> "$OUT/mla_decode_cfg.log"
  tail -6 "$OUT/mla_decode_cfg.log"
fi
if [ "${HP:-0}" = 1 ]; then  # a prefix hit's phases and timeline by its place in a round (serve.py's pattern)
  timeout ${HP_S:-150} python3 benchmarks/probe/hit_pattern.py ${HP_ARGS:-} --out "$OUT/hit_pattern.json" \
    > "$OUT/hit_pattern.log" 2>&1 || echo "hit pattern exit $?" >> "$OUT/hit_pattern.log"
  grep -v "^  " "$OUT/hit_pattern.log" | tail -8
fi
if [ "${HS:-0}" = 1 ]; then  # a 16K prefix hit under every combination of its switches, interleaved
  timeout ${HS_S:-200} python3 benchmarks/probe/hit_switches.py ${HS_ARGS:-} --out "$OUT/hit_switches.json" \
    > "$OUT/hit_switches.log" 2>&1 || echo "hit switches exit $?" >> "$OUT/hit_switches.log"
  tail -10 "$OUT/hit_switches.log"
fi
if [ "${MF:-0}" = 1 ]; then  # the experiment: the routed experts as one kernel, against the tile kernels
  timeout ${MF_S:-150} python3 benchmarks/probe/moe_fused.py --out "$OUT/moe_fused.json" > "$OUT/moe_fused.log" 2>&1 \
    || echo "moe fused exit $?" >> "$OUT/moe_fused.log"
  tail -4 "$OUT/moe_fused.log"
fi
if [ "${KS:-0}" = 1 ]; then  # short extend steps' KDA and conv launch settings; the intra kernel up to 32K tokens
  timeout ${KS_S:-240} python3 benchmarks/probe/kda_small.py --out "$OUT/kda_small.json" > "$OUT/kda_small.log" 2>&1 \
    || echo "kda small exit $?" >> "$OUT/kda_small.log"
  tail -10 "$OUT/kda_small.log"
fi
if [ "${PC:-0}" = 1 ]; then  # would a persistent decode kernel pay? (a GEMV chain)
  timeout ${PC_S:-150} python3 benchmarks/probe/persistent_chain.py ${PC_ARGS:-} --out "$OUT/persistent_chain.json" \
    > "$OUT/persistent_chain.log" 2>&1 || echo "persistent chain exit $?" >> "$OUT/persistent_chain.log"
  grep -v -i warn "$OUT/persistent_chain.log" | tail -40
fi
if [ "${GB:-0}" = 1 ]; then  # independent kernels of a layer on two streams of the graph against one after another
  timeout ${GB_S:-90} python3 benchmarks/probe/graph_branches.py --out "$OUT/graph_branches.json" \
    > "$OUT/graph_branches.log" 2>&1 || echo "graph branches exit $?" >> "$OUT/graph_branches.log"
  grep -v -i warn "$OUT/graph_branches.log" | tail -4
fi
if [ "${MB:-0}" = 1 ]; then  # a batch-1 step's MoE as one persistent kernel, launch settings, vs the composed path
  timeout ${MB_S:-150} python3 benchmarks/probe/moe_block.py ${MB_ARGS:-} --out "$OUT/moe_block.json" > "$OUT/moe_block.log" 2>&1 \
    || echo "moe block exit $?" >> "$OUT/moe_block.log"
  grep -v -i warn "$OUT/moe_block.log" | tail -16
fi
if [ "${OPS:-0}" = 1 ]; then
  timeout ${OPS_S:-150} python3 benchmarks/probe/decode_ops.py ${OPS_ARGS:-} --out "$OUT/decode_ops.json" > "$OUT/decode_ops.log" 2>&1 \
    || echo "decode ops exit $?" >> "$OUT/decode_ops.log"
  grep -E "==| t | mla " "$OUT/decode_ops.log"
fi
if [ "${SERVE:-1}" = 1 ]; then
  timeout ${SERVE_S:-420} python3 benchmarks/serve.py --out "$OUT/serve.json" > "$OUT/serve.log" 2>&1 \
    || echo "serve exit $?" >> "$OUT/serve.log"
  tail -14 "$OUT/serve.log"
fi
if [ "${TRAIN:-1}" = 1 ]; then
  TT="python3 benchmarks/train_throughput.py --warmup 3 --steps 8 --batch 8"
  timeout 150 $TT ${TRAIN_ARGS:-} --label plain --out "$OUT/train_plain.json" > "$OUT/train_plain.log" 2>&1 || echo "exit $?" >> "$OUT/train_plain.log"
  tail -n 30 "$OUT/train_plain.log"
  # the same step under environment switches, one run per ';'-separated set, e.g.
  # TRAIN_ENV="K3_JOINED_PROJ=1; K3_KDA_INTRA_BWD_KB=16 K3_KDA_INTRA_BWD_COLS_VB=16"
  IFS=';' read -ra SETS <<< "${TRAIN_ENV:-}"
  for i in "${!SETS[@]}"; do
    E=$(echo ${SETS[$i]})
    [ -z "$E" ] && continue
    timeout 150 env $E $TT ${TRAIN_ARGS:-} --label "$E" --out "$OUT/train_env$i.json" > "$OUT/train_env$i.log" 2>&1 \
      || echo "exit $?" >> "$OUT/train_env$i.log"
    echo "== $E"; tail -n 12 "$OUT/train_env$i.log"
  done
  if [ "${TRACE:-0}" = 1 ]; then
    timeout ${TRACE_S:-150} python3 benchmarks/train_throughput.py --warmup 2 --steps 3 --phase-steps 1 --batch 8 \
      --profile --trace /tmp/step_trace.json.gz --label trace > "$OUT/train_trace.log" 2>&1 \
      && python3 benchmarks/probe/trace_breakdown.py /tmp/step_trace.json.gz ${TRACE_ARGS:---top 30} \
      > "$OUT/trace_breakdown.log" 2>&1 || echo "trace exit $?" >> "$OUT/train_trace.log"
    tail -n 3 "$OUT/train_trace.log"; grep -A 40 "GPU idle" "$OUT/trace_breakdown.log"
  fi
  if [ "${COMPILE:-1}" = 1 ]; then
    timeout ${COMPILE_S:-200} $TT --compile --label compile --out "$OUT/train_compile.json" > "$OUT/train_compile.log" 2>&1 \
      || echo "exit $?" >> "$OUT/train_compile.log"
    tail -n 4 "$OUT/train_compile.log"
  fi
fi
