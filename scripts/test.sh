#!/usr/bin/env bash
# Set up, then run the test suite (GPU-only tests skip cleanly without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider --durations=10 "$@"
