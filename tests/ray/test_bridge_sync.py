"""Bridge conversion through the whole sync, on a local Ray cluster: 2 trainer ranks (TP=2, as the main job's) and
2 reference engines with frozen MTP drafts in the AITER layout.

One scenario (module fixture), then one assertion per claim:
- a raw trainer group takes one optimizer step and syncs on each transport;
- a bridge trainer group (`create_trainers(conversion="bridge")`, what `sync.conversion=bridge` starts) loaded
  from the same checkpoint first syncs its untrained weights (the engines go back to the checkpoint: bridge bytes
  really land), then takes the same step and syncs on each transport;
- the bridge syncs send the raw syncs' bytes (the trainers' per-tensor checksums are equal) and leave every engine
  with the raw syncs' weights (the engines' checksums are equal), every sync verified;
- with the frozen draft, `sync.selector=auto` resolves `all` in bridge mode and the draft-coverage check refuses
  it before anything is sent, naming the override `sync.selector=target`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import ray
from ray_fleet import RAY_TIMEOUT_S, Fleet, current_urls, started_fleet, target_checksum

from actors.controller import create_controller
from actors.trainer import TrainerGroup, create_trainers
from launch.fleet import start_job_actors
from miles_sync.config import ModelConfig, SyncConfig, TrainerConfig, load_config
from miles_sync.export.registry import ConversionMode
from miles_sync.job.placement import plan_colocated_feeds
from miles_sync.job.trainer import TrainBatch
from miles_sync.sync.report import SyncReport
from miles_sync.sync.selector import SelectorMode
from miles_sync.transport.base import TransportKind
from miles_sync.wire.protocol import Selector

pytestmark = pytest.mark.slow

TRANSPORTS = (TransportKind.DISTRIBUTED, TransportKind.COLOCATED)
MODEL = ModelConfig(arch="qwen3", speculative_algorithm="NEXTN", num_trained_mtp_layers=0)
TRAINER = TrainerConfig(tp=2, lr=1e-3)
# Small buckets: a sync of this 1.8 MiB model is several buckets, as a real one is many.
SYNC = dict(bucket_bytes=256 * 1024, http_timeout_s=20.0, collective_timeout_s=30.0, sync_timeout_s=120.0)
# One fixed batch of the synthetic language (prompt of 4 tokens, 4 completion tokens each), the same for both groups.
BATCH = TrainBatch(
    sequences=((1, 22, 127, 124, 109, 34, 187, 168), (5, 42, 227, 100, 245, 190, 183, 148)),
    num_prompt_tokens=(4, 4),
    rewards=(1.0, 0.0),
)


@dataclass(frozen=True, kw_only=True)
class Synced:
    report: SyncReport
    engine_checksums: tuple[str, ...]  # each engine's target checksum after the sync


@dataclass(frozen=True, kw_only=True)
class Scenario:
    initial: tuple[str, ...]  # the engines' target checksums as loaded from the checkpoint
    raw: dict[TransportKind, Synced]  # after one step, raw conversion
    bridge_untrained: Synced  # the bridge group's first sync, before its step (distributed)
    bridge: dict[TransportKind, Synced]  # after the same step, bridge conversion
    refused: SyncReport  # bridge, selector auto, frozen draft
    imports_bridge: dict[ConversionMode, tuple[bool, ...]]  # per trainer rank: megatron-bridge imported


@pytest.fixture(scope="module")
def fleet(cluster, reference_checkpoints, tmp_path_factory) -> Iterator[Fleet]:
    with started_fleet(
        checkpoint_dir=str(reference_checkpoints / "target"),
        log_dir=tmp_path_factory.mktemp("engines"),
        trainer=TRAINER,
        engine_collective_timeout_s=30.0,
        name="bridge",
    ) as fleet:
        yield fleet


@contextlib.contextmanager
def controller_for(fleet: Fleet, transport: TransportKind, conversion: ConversionMode, selector: SelectorMode):
    sync = SyncConfig(transport=transport, conversion=conversion, selector=selector, **SYNC)
    handle = create_controller(
        trainers=fleet.trainers.actors, engine_urls=current_urls(fleet.engines.actors), sync=sync, model=MODEL
    )
    try:
        yield handle
    finally:
        ray.get(handle.close.remote(), timeout=RAY_TIMEOUT_S)
        ray.kill(handle)


def sync_once(
    fleet: Fleet,
    transport: TransportKind,
    conversion: ConversionMode,
    selector: SelectorMode = SelectorMode.TARGET,
) -> Synced:
    with controller_for(fleet, transport, conversion, selector) as controller:
        report = ray.get(controller.sync.remote(raise_on_failure=False), timeout=RAY_TIMEOUT_S)
    return Synced(report=report, engine_checksums=engine_checksums(fleet))


def engine_checksums(fleet: Fleet) -> tuple[str, ...]:
    return tuple(target_checksum(url) for url in current_urls(fleet.engines.actors))


def imports_bridge(trainers: TrainerGroup) -> tuple[bool, ...]:
    """Per trainer rank: whether its process imported megatron-bridge (only bridge mode's exporter does)."""
    refs = [a.__ray_call__.remote(lambda self: "megatron.bridge" in sys.modules) for a in trainers.actors]
    return tuple(ray.get(refs, timeout=RAY_TIMEOUT_S))


def train_step(fleet: Fleet) -> None:
    steps = fleet.trainers.train_step(BATCH, timeout_s=RAY_TIMEOUT_S)
    assert len({s.loss for s in steps}) == 1, f"TP ranks computed different losses: {steps}"


@pytest.fixture(scope="module")
def scenario(fleet) -> Scenario:
    initial = engine_checksums(fleet)
    train_step(fleet)  # the fleet's trainers are raw (the default conversion)
    raw = {t: sync_once(fleet, t, ConversionMode.RAW) for t in TRANSPORTS}
    raw_imports = imports_bridge(fleet.trainers)

    # What sync.conversion=bridge starts: every rank exports with megatron-bridge, colocated feeds included.
    fleet.trainers.shutdown(timeout_s=30.0)
    fleet.trainers = create_trainers(
        trainer=TRAINER,
        checkpoint_dir=fleet.checkpoint_dir,
        placement=fleet.placed,
        feeds=plan_colocated_feeds(fleet.plan),
        conversion=ConversionMode.BRIDGE,
    )
    refused = sync_once(fleet, TransportKind.DISTRIBUTED, ConversionMode.BRIDGE, SelectorMode.AUTO).report
    bridge_untrained = sync_once(fleet, TransportKind.DISTRIBUTED, ConversionMode.BRIDGE)
    train_step(fleet)
    bridge = {t: sync_once(fleet, t, ConversionMode.BRIDGE) for t in TRANSPORTS}
    return Scenario(
        initial=initial,
        raw=raw,
        bridge_untrained=bridge_untrained,
        bridge=bridge,
        refused=refused,
        imports_bridge={ConversionMode.RAW: raw_imports, ConversionMode.BRIDGE: imports_bridge(fleet.trainers)},
    )


def assert_verified(synced: Synced, *, num_tensors: int) -> None:
    report = synced.report
    assert report.committed, report.summary()
    assert report.selector is Selector.TARGET
    assert report.num_tensors == num_tensors and report.num_buckets > 1
    for engine in report.engines:
        assert engine.success and not engine.is_stale, engine
        assert engine.num_verified_tensors == num_tensors, engine
    assert len(set(synced.engine_checksums)) == 1, "every engine holds the same weights"


def test_bridge_conversion_exports_on_every_trainer_rank(scenario):
    assert scenario.imports_bridge == {ConversionMode.RAW: (False, False), ConversionMode.BRIDGE: (True, True)}


def test_every_sync_is_verified(scenario, fleet):
    for synced in (*scenario.raw.values(), scenario.bridge_untrained, *scenario.bridge.values()):
        assert_verified(synced, num_tensors=fleet.num_tensors)
    assert {s.report.transport for s in scenario.bridge.values()} == {t.value for t in TRANSPORTS}


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda t: t.value)
def test_bridge_sends_the_raw_bytes(scenario, transport):
    raw, bridge = scenario.raw[transport].report, scenario.bridge[transport].report
    assert bridge.checksums and bridge.checksums == raw.checksums
    assert bridge.num_bytes == raw.num_bytes


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda t: t.value)
def test_bridge_leaves_the_engines_with_the_raw_weights(scenario, transport):
    raw, bridge = scenario.raw[transport], scenario.bridge[transport]
    assert bridge.engine_checksums == raw.engine_checksums
    assert raw.engine_checksums != scenario.initial, "the step moved the weights"
    digest = hashlib.sha256(json.dumps(bridge.report.checksums, sort_keys=True).encode()).hexdigest()[:16]
    print(
        f"{transport.value}: engines raw {raw.engine_checksums} bridge {bridge.engine_checksums}; sent tensors "
        f"{len(bridge.report.checksums)}, digest of the per-tensor checksums {digest}"
    )


def test_bridge_bytes_land(scenario):
    # Between the raw step's sync and the bridge step's sync, the bridge group sent the checkpoint's weights.
    assert scenario.bridge_untrained.engine_checksums == scenario.initial
    assert scenario.bridge_untrained.report.checksums != scenario.raw[TransportKind.DISTRIBUTED].report.checksums


def test_frozen_draft_refuses_auto_in_bridge_mode_naming_the_override(scenario):
    refused = scenario.refused
    assert not refused.committed and refused.num_bytes == 0
    assert refused.error is not None
    assert "'all' includes the mtp draft" in refused.error and "sync.selector=target" in refused.error, refused.error


def test_the_main_job_threads_sync_conversion_to_every_trainer_rank(scenario, fleet, tmp_path):
    # The main job's own start-up (launch.fleet.start_job_actors) with the documented overrides, on this cluster:
    # every trainer rank exports with megatron-bridge and the sync (selector target) commits, verified, sending
    # the checkpoint's bytes, which the bridge group of the scenario sent before its step.
    overrides = ["sync.conversion=bridge", "sync.selector=target", "engines.count=1", "run_name=bridge-job"]
    config = load_config(
        overrides=[*overrides, f"output_dir={tmp_path}", f"model.checkpoint_dir={fleet.checkpoint_dir}"]
    )
    with start_job_actors(config, log=print) as job:
        assert imports_bridge(job.trainers) == (True, True)
        report = ray.get(job.controller.sync.remote(raise_on_failure=False), timeout=RAY_TIMEOUT_S)
    assert report.committed and report.selector is Selector.TARGET, report.summary()
    assert all(e.success and e.num_verified_tensors == report.num_tensors for e in report.engines), report.engines
    assert report.checksums == scenario.bridge_untrained.report.checksums
