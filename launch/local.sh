#!/usr/bin/env bash
# The README's first command. Installs if needed, then runs the main job. Until the Ray-launched RL loop lands,
# the job is the export parity check: a TP=2 Megatron Qwen3 model with an MTP layer on two local gloo processes,
# exported to HF tensors and compared against transformers' logits (last line: max_abs_logit_diff=... OK).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled
exec .venv/bin/python -m miles_sync.export.parity --arch qwen3 --mode raw --tp 2 --pp 1 --ep 1 --mtp-layers 1 "$@"
