"""The main job's entry point: `python -m launch.run [overrides]`, e.g. `sync.transport=colocated` or
`demo=frozen_draft_bug`.

Hydra composes conf/default.yaml with the overrides; the result is validated into MilesSyncConfig before any actor
starts (an invalid value fails here, naming its key). Runs locally (starts a Ray cluster on 127.0.0.1) or, under
`ray job submit` / with `cluster.address`, on that cluster. Hydra's own output directory and logging are off: the
job writes `<output_dir>/<run_name>/report.json` and `report.png`.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from miles_sync.config import DEFAULT_CONFIG_DIR, to_config

_HYDRA_QUIET = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


@hydra.main(config_path=str(DEFAULT_CONFIG_DIR), config_name="default", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        config = to_config(cfg)
    except ValueError as exc:
        print(f"launch.run: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from launch.cluster import prepare_environment

    prepare_environment(config.cluster)  # before Ray is imported
    from launch.job import run_job  # imported after validation: it pulls in Ray and torch

    run_job(config)


if __name__ == "__main__":
    sys.argv[1:1] = _HYDRA_QUIET  # the user's overrides come after, so they can still set these
    main()
