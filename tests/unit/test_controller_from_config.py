"""The controller built from the job's config without Ray (miles_sync.embedding), the source check at construction,
and the fleet's per-engine records (miles_sync.sync.fleet): pure, no engine needed."""

from __future__ import annotations

import pytest

from miles_sync.config import ModelConfig, SyncConfig
from miles_sync.embedding import controller_from_config, controller_options, sender_settings
from miles_sync.engine.client import EngineClient
from miles_sync.sync.fleet import EngineRecord, Fleet
from miles_sync.sync.report import EngineResult, PhaseTimes, SyncReport
from miles_sync.sync.weight_source import WeightSource
from miles_sync.wire.protocol import PauseMode, Selector

URL = "http://127.0.0.1:1"


class NamesOnly(WeightSource):
    async def exported_names(self):
        return ()


@pytest.mark.parametrize(
    ("pause_mode", "flushes"), [(PauseMode.ABORT, True), (PauseMode.RETRACT, True), (PauseMode.IN_PLACE, False)]
)
def test_updates_flush_the_prefix_cache_where_the_pause_empties_the_engines(pause_mode, flushes):
    # abort and retract leave no request running, so each update flushes as it loads and the session sends no
    # /flush_cache (a gc pass on a CPU SGLang server); in_place keeps requests running: SGLang refuses that flush.
    assert sender_settings(SyncConfig(pause_mode=pause_mode)).flush_cache is flushes
    source = NamesOnly()
    source.flushes_cache = flushes
    controller = controller_from_config(
        source=source, engine_urls=[URL], sync=SyncConfig(pause_mode=pause_mode), model=ModelConfig()
    )
    assert controller.engine_urls == (URL,)  # a consistent pair: the controller accepts it


def test_the_options_follow_the_config():
    sync = SyncConfig(pause_mode=PauseMode.RETRACT, verify=False, version_file="/tmp/v.json")
    options = controller_options(source=NamesOnly(), engine_urls=[URL], sync=sync, model=ModelConfig())
    assert options["pause_mode"] is PauseMode.RETRACT and options["verify"] is False
    assert options["version_file"] == "/tmp/v.json" and options["lora_name"] is None
    assert options["timeouts"].control_s == sync.http_timeout_s and options["timeouts"].sync_s == sync.sync_timeout_s


def test_a_source_that_does_not_subclass_weight_source_is_refused_at_construction():
    """Mutation caught: dropping the check lets a duck-typed source through, to fail later inside a sync with an
    AttributeError."""

    class DuckTyped:  # written against an earlier protocol: no connect(), no check_engines()
        async def exported_names(self):
            return ()

        async def send(self, **_):
            raise AssertionError("never reached")

    with pytest.raises(TypeError, match="DuckTyped does not subclass miles_sync.api.WeightSource"):
        controller_from_config(source=DuckTyped(), engine_urls=[URL], sync=SyncConfig(), model=ModelConfig())


def _record(url: str) -> EngineRecord:
    return EngineRecord(url=url, client=EngineClient(url, timeout_s=1.0), tp_size=1)


def _report(version: str, *results: EngineResult) -> SyncReport:
    return SyncReport(
        version=version,
        previous_version="",
        committed=all(r.success for r in results),
        selector=Selector.TARGET,
        transport="distributed",
        num_bytes=0,
        num_buckets=0,
        num_tensors=0,
        phases=PhaseTimes(),
        total_s=0.0,
        engines=results,
    )


def test_the_fleet_holds_serves_and_forgets_whole_records():
    """Held implies stale; the first hold reason stays; a verified engine is neither held nor behind and keeps its
    checksum baseline; a stale one loses it; leaving takes the whole record (LoRA adapter, canary baseline and route
    included). Mutations caught: `hold` overwriting the first reason, `record` keeping a stale engine's baseline,
    `serve` leaving `is_behind` set, `remove` leaving a record behind."""
    a, b, c = "http://127.0.0.1:2", "http://127.0.0.1:3", "http://127.0.0.1:4"
    fleet = Fleet([a, b])
    fleet.attach(_record(a))
    assert not fleet.is_connected
    fleet.attach(_record(b))
    fleet[b].is_behind = True
    assert fleet.is_connected and fleet.serving == (a,) and fleet.stale == (b,) and fleet.held == {}

    fleet.record(_report("1", EngineResult(url=a, success=True, is_stale=False, weights_digest="d1"),
                         EngineResult(url=b, success=True, is_stale=False, weights_digest="d2")))  # fmt: skip
    assert fleet.serving == (a, b) and fleet.baselines[a].digest == "d1" and fleet.baselines[b].digest == "d2"

    fleet.record(_report("2", EngineResult(url=a, success=True, is_stale=False, weights_digest="d3"),
                         EngineResult(url=b, success=False, is_stale=True, message="send failed")))  # fmt: skip
    fleet.hold(b, "a later reason")
    assert fleet.held == {b: "sync v2: send failed"} and fleet.stale == (b,)
    assert set(fleet.baselines) == {a} and fleet.baselines[a].digest == "d3"

    record = fleet[b]
    record.lora_served, record.canary_baseline, record.is_routed = "policy_v1", 2.5, True
    replacement = _record(c)
    replacement.is_behind = True
    assert fleet.replace(b, replacement) is record
    assert fleet.urls == (a, c) and fleet.held == {} and fleet.routed == () and fleet.canary_baselines == {}
    assert fleet.remove(a) is not None and fleet.urls == (c,) and fleet.baselines == {} and fleet.stale == (c,)
    fleet.serve(c)
    assert fleet.serving == (c,)
