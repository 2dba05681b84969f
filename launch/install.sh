#!/usr/bin/env bash
# Creates .venv and installs miles_sync with its test tools. Idempotent: a stamp of the install inputs skips work
# on re-runs. On machines without a GPU the CPU build of torch is selected through constraints/cpu.txt; set
# MILES_SYNC_TORCH=system to keep whatever torch the environment provides (GPU clusters).
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[install] creating .venv with $($python_bin --version)" >&2
    "$python_bin" -m venv .venv
fi

constraint_args=()
if [ "${MILES_SYNC_TORCH:-cpu}" = "cpu" ]; then
    constraint_args=(-c constraints/cpu.txt)
fi

stamp_inputs=$(cat pyproject.toml constraints/cpu.txt constraints/bridge.txt launch/install.sh launch/install_bridge.sh \
    2>/dev/null | sha256sum | cut -c1-16)
stamp=".venv/.miles_sync-install-${stamp_inputs}-${MILES_SYNC_TORCH:-cpu}"
if [ -f "$stamp" ]; then
    exit 0
fi

echo "[install] installing miles_sync and its dependencies (first run takes a few minutes)" >&2
.venv/bin/python -m pip install -q --disable-pip-version-check "${constraint_args[@]}" -e ".[dev]" 2>&1 \
    | grep -v "^WARNING: Location" || true
# pip's status is lost in the pipe above: check the install took.
.venv/bin/python -c "import miles_sync, torch, ray, megatron.core, transformers, aiohttp" \
    || { echo "[install] dependency install failed" >&2; exit 1; }

if [ -f launch/install_bridge.sh ]; then
    bash launch/install_bridge.sh "${constraint_args[@]}"
fi
rm -f .venv/.miles_sync-install-*
touch "$stamp"
echo "[install] done" >&2
