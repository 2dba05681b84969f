"""The main job's config resolved against its checkpoint, before anything starts: plain and unit-tested.

`resolve_job` fills in what the config leaves to the checkpoint (the checkpoint directory itself, built once for a
built-in arch; the block-FP8 block size for `sync.fp8_block: null`) by constructing a new config, so the resolved
record passes the same validation as any other, and then refuses a checkpoint the trainer layout cannot split or
the export cannot convert, before placement. `engine_settings` and `trainer_lora` are what the job's engines and
trainer ranks are started with.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_sync.config import MilesSyncConfig, SyncMode
from miles_sync.engine.kinds import EngineKind
from miles_sync.engine.reference.checkpoints import BUILT_IN_ARCHS, cached_checkpoints
from miles_sync.engine.settings import EngineSettings
from miles_sync.env import read_environment
from miles_sync.megatron.lora import LoraSpec
from miles_sync.transport.base import transport_spec
from miles_sync.weights.fp8_checkpoint import default_block, fp8_checkpoint, fp8_serving_problems
from miles_sync.wire.text import raise_if

__all__ = ["engine_device", "engine_settings", "resolve_job", "trainer_lora"]


@dataclass(frozen=True, kw_only=True)
class ResolvedJob:
    """The config with everything the checkpoint decides filled in, and the checkpoint the trainers load."""

    config: MilesSyncConfig
    checkpoint: str


def resolve_job(config: MilesSyncConfig, *, log: Callable[[str], None]) -> ResolvedJob:
    """The checkpoint (`model.checkpoint_dir`, else the built-in arch's cached one, built on first use), the FP8
    block `sync.fp8_block: null` resolves to for it, then the checkpoint checks; ValueError naming each problem."""
    checkpoint = _checkpoint_dir(config, log=log)
    hf_config = _hf_config(checkpoint)
    spec = config.sync.quantization_spec
    if spec is not None and config.sync.fp8_block is None and hf_config is not None:
        block = default_block(hf_config, tp_size=config.engines.tp).block
        log(f"block FP8: sync.fp8_block=null resolves to {list(block)} for this model at engine TP={config.engines.tp}")
        config = dataclasses.replace(config, sync=dataclasses.replace(config.sync, fp8_block=block))
    if hf_config is not None:  # a directory without config.json is left to the engines
        problems = checkpoint_problems(config, hf_config)
        raise_if(problems, what=f"checkpoint {checkpoint}")
    return ResolvedJob(config=config, checkpoint=checkpoint)


def checkpoint_problems(config: MilesSyncConfig, hf_config: dict[str, Any]) -> list[str]:
    """What the trainer layout cannot split (layers per pp, experts per ep), `sync.conversion` cannot export (its
    config.json may name another family than `model.arch`, or MoE experts) and SGLang's block-FP8 size check refuses
    at the engines' TP size."""
    problems = config.trainer.checkpoint_problems(hf_config) + config.sync.checkpoint_problems(
        hf_config, num_trained_mtp_layers=config.model.num_trained_mtp_layers
    )
    spec = config.sync.quantization_spec
    if spec is not None:
        problems += [
            f"sync.fp8_block={list(spec.block)}: {p}"
            for p in fp8_serving_problems(hf_config, tp_size=config.engines.tp, spec=spec)
        ]
    return problems


def engine_settings(job: ResolvedJob, *, device: str | None, sglang_python: str | None) -> EngineSettings:
    """What each launched engine serves and how: the checkpoint (its block-FP8 copy under block FP8: the engines'
    quantization follows their checkpoint, as SGLang's does), the LoRA room under sync.mode=lora. `device`: resolved
    on the launching node; `sglang_python`: the SGLang server's interpreter (engines.kind=sglang only)."""
    config, spec = job.config, job.config.sync.quantization_spec
    served = job.checkpoint if spec is None else str(fp8_checkpoint(job.checkpoint, spec))
    return config.engines.launch_settings(
        model_dir=served,
        collective_timeout_s=config.sync.collective_timeout_s,
        speculative_algorithm=config.model.speculative_algorithm,
        lora=config.sync.lora.engine_settings() if config.sync.mode is SyncMode.LORA else None,
        device=device,
        server_python=sglang_python if config.engines.kind is EngineKind.SGLANG else None,
        custom_weight_loaders=transport_spec(config.sync.transport).engine_weight_loaders(),
    )


def engine_device(device: str) -> str | None:
    """`engines.device` on this node: auto is cpu where torch sees no CUDA device (the engines' nodes are assumed to
    be of the driver's kind; give cpu or cuda explicitly for a mixed cluster), None (SGLang's default) otherwise."""
    if device != "auto":
        return device
    import torch  # the driver's first torch import: only a job that launches engines needs it

    return None if torch.cuda.is_available() else "cpu"


def trainer_lora(config: MilesSyncConfig) -> LoraSpec | None:
    """What the trainer ranks adapt under sync.mode=lora (None: they train every weight)."""
    if config.sync.mode is not SyncMode.LORA:
        return None
    lora = config.sync.lora
    return LoraSpec(rank=lora.rank, alpha=lora.alpha, target_modules=lora.target_modules)


def _checkpoint_dir(config: MilesSyncConfig, *, log: Callable[[str], None]) -> str:
    if config.model.checkpoint_dir is not None:
        return config.model.checkpoint_dir
    arch = config.model.arch
    if arch not in BUILT_IN_ARCHS:
        raise ValueError(
            f"model.checkpoint_dir is null and model.arch={arch!r} has no built-in reference checkpoint; "
            f"built-in archs: {', '.join(BUILT_IN_ARCHS)} (or set model.checkpoint_dir)"
        )
    cache = read_environment().cache_dir
    log(f"reference {arch} checkpoint: {cache} (built once, a few minutes, on the first run)")
    return str(cached_checkpoints(cache, arch=arch) / "target")


def _hf_config(checkpoint: str) -> dict[str, Any] | None:
    path = Path(checkpoint) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None
