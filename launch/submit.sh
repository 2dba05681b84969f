#!/usr/bin/env bash
# Submit the main job to a running Ray cluster:
#   launch/submit.sh [--address http://HEAD:8265] [overrides...]
# e.g. launch/submit.sh --address http://head:8265 engines.kind=sglang engines.count=4 sync.transport=distributed
# The repository is uploaded as the job's working directory; the entry point runs `python -m launch.run` with the
# overrides on the cluster (which joins it through RAY_ADDRESS). PYTHON and RAY choose the interpreter and CLI.
# On several nodes, place the roles with custom node resources, e.g.
#   cluster.trainer_node_resource=trainer_node cluster.engine_node_resource=rollout_node cluster.engine_strategy=SPREAD
# (README "Several nodes"); every engine and trainer rank binds its own node's address.
set -euo pipefail
cd "$(dirname "$0")/.."
address="${RAY_JOB_ADDRESS:-http://127.0.0.1:8265}"
if [[ "${1:-}" == "--address" ]]; then
  address="$2"
  shift 2
fi
exec "${RAY:-ray}" job submit --address "$address" --working-dir . -- "${PYTHON:-python}" -m launch.run "$@"
