#!/usr/bin/env bash
# The main job: set up, then train k3-tiny on the built-in corpus (CPU is enough). Extra args go to `k3 train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec k3 train "$@"
