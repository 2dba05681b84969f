#!/usr/bin/env bash
# Installs the released SGLang 0.5.23 server and the SGLang router (sglang-router 0.3.2) into their own venv
# (.venv-sglang) for the real-SGLang test tier, the router tests, CPU runs of `engines.kind=sglang` and
# `rollout.router=true`. Never into .venv: sglang's metadata pins a CUDA
# build of torch (2.14.1) and transformers 5, and miles_sync does not depend on sglang. Idempotent (a stamp of the
# install inputs skips work on re-runs). On a GPU node install SGLang as its own docs say instead.
#
# On CPU: torch is the CPU wheel (constraints/cpu.txt); sglang, compressed-tensors, xgrammar, triton and
# torchvision go in with --no-deps (their declared deps are CUDA builds); the pure-Python runtime dependencies are
# named below at the versions sglang 0.5.23's metadata pins. launch/sglang_cpu/ holds the import shims a CPU server
# needs (see that module's docstring), loaded only when MILES_SYNC_SGLANG_CPU_SHIM=1.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-sglang
python_bin="${PYTHON:-python3}"
step() { echo "[install_sglang] $*" >&2; }
fail() { echo "[install_sglang] FAILED at: $*" >&2; exit 1; }

stamp_inputs=$(cat constraints/cpu.txt constraints/sglang.txt launch/install_sglang.sh launch/sglang_cpu/*.py \
    | sha256sum | cut -c1-16)
stamp="$venv/.sglang-install-${stamp_inputs}"
if [ -f "$stamp" ]; then
    exit 0
fi
start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
    step "creating $venv with $($python_bin --version)"
    "$python_bin" -m venv "$venv" || fail "python -m venv $venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check -c constraints/cpu.txt -c constraints/sglang.txt)
quiet() { grep -v "^WARNING: Location" || true; }

step "torch (CPU build) and sglang 0.5.23 (first run takes a few minutes)"
"${pip[@]}" torch 2>&1 | quiet
"${pip[@]}" --no-deps sglang compressed-tensors xgrammar triton torchvision 2>&1 | quiet
# sglang's pure-Python runtime dependencies, found by importing the server until it stopped failing.
"${pip[@]}" aiohttp fastapi uvicorn uvloop orjson pydantic pyzmq psutil requests transformers tokenizers \
    safetensors numpy pybase64 setproctitle msgspec xxhash python-multipart prometheus-client packaging regex \
    tqdm einops interegular partial_json_parser pillow scipy IPython openai tiktoken sentencepiece watchfiles \
    zstandard distro easydict python-dateutil blobfile gguf dill apache-tvm-ffi loguru jsonschema \
    openai-harmony anthropic mistral_common soundfile 2>&1 | quiet

# The SGLang router (rollout.router=true; miles_sync.engine.router): its dependencies are among the ones above.
"${pip[@]}" --no-deps sglang-router 2>&1 | quiet

# The server is started through miles_sync.engine.sglang_launch (stdlib only): miles_sync without its deps.
"${pip[@]}" --no-deps -e . 2>&1 | quiet

step "CPU import shims (active only with MILES_SYNC_SGLANG_CPU_SHIM=1)"
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || fail "locating site-packages"
cp launch/sglang_cpu/miles_sync_sglang_cpu_shim.py "$site/"
echo "import os; os.environ.get('MILES_SYNC_SGLANG_CPU_SHIM') == '1' and __import__('miles_sync_sglang_cpu_shim').install()" \
    > "$site/miles_sync_sglang_cpu_shim.pth"

# pip's status is lost in the pipes above: check that the server's entry point imports the way it runs on CPU.
step "checking that sglang.launch_server imports"
MILES_SYNC_SGLANG_CPU_SHIM=1 SGLANG_USE_CPU_ENGINE=1 "$py" -c "import sglang.launch_server, sglang.srt.entrypoints.http_server, miles_sync.engine.sglang_launch" \
    || fail "importing sglang.launch_server in $venv (run the line above by hand to see why)"
"$py" -c "import sglang_router.router, sglang_router.router_args, miles_sync.engine.router_launch" \
    || fail "importing the SGLang router in $venv (run the line above by hand to see why)"
torch_version=$("$py" -c "import torch; print(torch.__version__)")
case "$torch_version" in
    *+cpu) ;;
    *) fail "$venv has torch $torch_version, not the CPU build" ;;
esac
rm -f "$venv"/.sglang-install-*
touch "$stamp"
step "sglang $("$py" -c 'import importlib.metadata as m; print(m.version("sglang"))') with torch $torch_version ready in $venv in $(( $(date +%s) - start )) s"
