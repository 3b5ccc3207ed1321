#!/usr/bin/env bash
# One device call (≤ 10 min) for the post-training figures of k3-small on one H200, results in $OUT:
#   1. benchmarks/post_train.py over all three domains (easy levels; SFT → throughput λ=1 / λ=0.5 → RL max → high
#      → low in every domain), --no-checkpoints, within POST_S seconds;
#   2. benchmarks/agreement.py on the chain's final model: greedy engine vs model.generate() in fp32 and bf16.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
OUT=${OUT:-out}; mkdir -p "$OUT"
RUN=${RUN:-/tmp/post-small}
rm -rf "$RUN"
timeout $(( ${POST_S:-470} + 60 )) python3 benchmarks/post_train.py --preset k3-small --device cuda --no-checkpoints \
  --out "$RUN" --time-budget ${POST_S:-470} --domains general,agent,coding --levels easy --sft-steps 400 --sft-lr 1e-3 \
  --sft-n ${SFT_N:-192} --sft-n-standard 0 --rl-steps 6 --rl-lr 1e-4 --prompts 8 --samples 8 --pool 64 --eval-n 32 \
  > "$OUT/post_train.log" 2>&1 || echo "post_train exit $?" >> "$OUT/post_train.log"
tail -40 "$OUT/post_train.log"
cp "$RUN"/post_train.json "$RUN"/*.png "$OUT/" 2>/dev/null
final=$(ls -dt "$RUN"/rl-*/model 2>/dev/null | head -1)
if [ -n "$final" ]; then
  timeout ${AGREE_S:-150} python3 benchmarks/agreement.py --checkpoint "$final" --device cuda --n 16 --new-tokens 48 \
    --domains general,agent,coding --out "$OUT/agreement.json" > "$OUT/agreement.log" 2>&1 || echo "agreement exit $?" >> "$OUT/agreement.log"
  tail -3 "$OUT/agreement.log"
fi
