#!/usr/bin/env bash
# The project's test command: installs if needed (the project's .venv, and the real SGLang server's .venv-sglang
# for the tests/sglang tier; a failed install fails the run, naming the step), checks style (ruff) and the
# layering (import-linter contracts in pyproject.toml), then runs the whole suite. Extra arguments go to pytest.
# A run that collects no test (pytest exit code 5) is a failure, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh || exit 1
bash launch/install_sglang.sh || { echo "[test] launch/install_sglang.sh failed: the sglang tier cannot run" >&2; exit 1; }
.venv/bin/ruff check . || exit 1
.venv/bin/ruff format --check . || exit 1
.venv/bin/lint-imports --no-cache || exit 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled
.venv/bin/python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "[test] pytest collected no tests: failing" >&2
    exit 1
fi
exit "$status"
