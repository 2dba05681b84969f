"""The CUDA variants of the same sync: the trainer's model and buckets on a GPU, CUDA IPC handles (colocated) and
an NCCL update group (distributed). Skipped without CUDA (conftest); the NCCL case needs two GPUs, because NCCL
refuses two ranks of one communicator on the same device.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import ray
import torch
from ray_fleet import RAY_TIMEOUT_S, prompts

from actors.controller import create_controller
from actors.rollout import create_engines
from actors.trainer import create_trainers
from miles_sync.config import ModelConfig, SyncConfig, TrainerConfig
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.job.placement import Resources
from miles_sync.transport.base import TransportKind
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.protocol import SamplingParams

pytestmark = pytest.mark.gpu

MODEL = ModelConfig(arch="qwen3", speculative_algorithm="NEXTN", num_trained_mtp_layers=0)


def sync_once(*, transport: TransportKind, backend: str, gpus_per_actor: float, checkpoints, log_dir) -> None:
    target = str(checkpoints / "target")
    spec = ReferenceEngineSpec(model_dir=target, draft_kind=DraftKind.MTP, weight_layout=WeightLayout.AITER)
    on_gpu = Resources(num_cpus=0.01, num_gpus=gpus_per_actor)
    with ExitStack() as stack:
        # The engine actor holds a GPU share so its server (a child process) sees the device for IPC / NCCL.
        engines = create_engines(specs=[spec], log_dir=log_dir, resources=on_gpu)
        stack.callback(engines.shutdown)
        trainers = create_trainers(trainer=TrainerConfig(tp=1), checkpoint_dir=target, resources=on_gpu)
        stack.callback(trainers.shutdown)
        controller = create_controller(
            trainers=trainers.actors,
            engine_urls=engines.urls,
            sync=SyncConfig(transport=transport),
            model=MODEL,
            backend=backend,
            device="cuda",
        )
        stack.callback(ray.kill, controller)
        report = ray.get(controller.sync.remote(), timeout=RAY_TIMEOUT_S)
        assert report.committed, report.summary()
        (engine,) = report.engines
        assert engine.success and engine.num_verified_tensors == trainers.ranks[0].num_exported_tensors
        samples = ray.get(
            engines.actors[0].generate.remote(prompts(0), sampling=SamplingParams(max_new_tokens=16, temperature=0.0)),
            timeout=RAY_TIMEOUT_S,
        )
        assert {s.weight_version for s in samples} == {report.version}
        ray.get(controller.close.remote(), timeout=RAY_TIMEOUT_S)


def test_colocated_sync_with_cuda_ipc_handles(cluster, reference_checkpoints, tmp_path):
    # Trainer and engine share one GPU: the bucket travels as a CUDA IPC handle to the trainer's device memory.
    sync_once(
        transport=TransportKind.COLOCATED,
        backend="nccl",
        gpus_per_actor=0.5,
        checkpoints=reference_checkpoints,
        log_dir=tmp_path,
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL group needs one GPU per rank")
def test_distributed_sync_over_nccl(cluster, reference_checkpoints, tmp_path):
    sync_once(
        transport=TransportKind.DISTRIBUTED,
        backend="nccl",
        gpus_per_actor=1.0,
        checkpoints=reference_checkpoints,
        log_dir=tmp_path,
    )
