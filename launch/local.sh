#!/usr/bin/env bash
# The README's first command: installs into .venv if needed, then runs the main job on the embedded default (a
# local Ray cluster on 127.0.0.1, 2 Megatron trainer ranks with TP=2, 2 CPU reference engines with a frozen MTP
# draft, 10 rounds of GRPO). Extra arguments are Hydra overrides, e.g. `bash launch/local.sh demo=frozen_draft_bug`.
# Writes outputs/<run_name>/report.json and report.png.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
# Real SGLang servers and the SGLang router run from their own venv (launch/install_sglang.sh), installed on first
# use.
for arg in "$@"; do
    if [ "$arg" = "engines.kind=sglang" ] || [ "$arg" = "rollout.router=true" ]; then
        bash launch/install_sglang.sh
        break
    fi
done
exec .venv/bin/python -m launch.run "$@"
