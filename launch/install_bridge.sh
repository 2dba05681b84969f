#!/usr/bin/env bash
# Installs megatron-bridge into .venv for bridge-mode export, keeping every version launch/install.sh chose
# (torch, transformers, hydra-core, megatron-core). See constraints/bridge.txt for why this is a script and not a
# pip extra. Extra arguments go to pip (launch/install.sh passes `-c constraints/cpu.txt` on CPU machines).
# Idempotent: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."

py=.venv/bin/python
pip_args=(-q --disable-pip-version-check -c constraints/bridge.txt "$@")
start=$(date +%s)

# The light dependencies megatron-bridge's import path needs; its CUDA-only ones are left out on purpose.
light=(rich einops)
# A CUDA build of torch brings the triton it was built against: never replace it.
"$py" -c "import triton" 2>/dev/null || light+=(triton)
"$py" -m pip install "${pip_args[@]}" "${light[@]}" 2>&1 | grep -v "^WARNING: Location" || true
"$py" -m pip install "${pip_args[@]}" --no-deps megatron-bridge 2>&1 | grep -v "^WARNING: Location" || true

# pip's status is lost in the pipes above: check that bridge mode imports (through the CPU shims on CPU).
"$py" -c "from miles_sync.export.bridge import prepare_megatron_bridge; prepare_megatron_bridge()" 2>/dev/null \
    || { echo "[install_bridge] megatron-bridge does not import; run: $py -c 'from miles_sync.export.bridge import prepare_megatron_bridge; prepare_megatron_bridge()'" >&2; exit 1; }
echo "[install_bridge] megatron-bridge $("$py" -c 'import importlib.metadata as m; print(m.version("megatron-bridge"))') ready in $(( $(date +%s) - start )) s" >&2
