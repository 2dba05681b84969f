"""The frozen-draft guard against reference engines: one that honours the selector (the guard passes and says so)
and one that ignores it as a server without selector support does (`--finalize-policy no_selector`: every runner in
every session, every runner post-processed at its end, the AITER shuffle applied to the frozen draft once more).
The guard must catch the second at its first sync, name the draft parameter, and hold the engine with the shuffled
draft as it is (never written to)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from reference_server import reference_server
from sender_host import ProcessSource, SenderSettings

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.wire.protocol import PauseMode, Selector, WeightsCheckerAction, WeightsCheckerRequest

pytestmark = pytest.mark.multiproc

TIMEOUTS = SessionTimeouts(control_s=20.0, sync_s=90.0)
FROZEN = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
TRAINED = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=1, conversion_mode=ConversionMode.RAW
)


@pytest.fixture(scope="module")
def source(reference_checkpoints):
    process_source = ProcessSource(target_dir=reference_checkpoints / "target")
    yield process_source
    process_source.shutdown()


@contextlib.contextmanager
def engine(checkpoints, log_dir, *, finalize_policy: str):
    with reference_server(
        model=checkpoints / "target",
        log_dir=log_dir,
        draft_kind="mtp",
        weight_layout="aiter",
        finalize_policy=finalize_policy,
        extra_args=("--collective-timeout-s", "15"),
    ) as server:
        yield server


async def draft_checksums(url: str) -> dict[str, str]:
    async with EngineClient(url, timeout_s=20.0) as client:
        answer = await client.weights_checker(
            WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.DRAFT)
        )
    return dict(answer.ranks[0].checksums)


def run_syncs(url: str, source, *, inputs: SelectorInputs, include_mtp: bool, steps: tuple[int, ...]):
    async def main():
        await source.call(
            "configure", SenderSettings(transport="distributed", bucket_bytes=512 * 1024, include_mtp=include_mtp)
        )
        before = await draft_checksums(url)
        ctl = SyncController(
            engine_urls=[url],
            source=source,
            transport="distributed",
            selector_inputs=inputs,
            pause_mode=PauseMode.RETRACT,
            verify=True,
            timeouts=TIMEOUTS,
            show_progress=False,
        )
        await ctl.connect()
        reports = []
        try:
            for step in steps:
                await source.call("step", step)
                reports.append(await ctl.sync(raise_on_failure=False))
            held = dict(ctl.held_engines)
        finally:
            await ctl.close()
        return before, reports, held, await draft_checksums(url)

    return asyncio.run(main())


def test_the_guard_passes_and_says_so_when_the_selector_is_honoured(reference_checkpoints, source, tmp_path):
    with engine(reference_checkpoints, tmp_path, finalize_policy="sglang") as server:
        before, reports, held, after = run_syncs(server.url, source, inputs=FROZEN, include_mtp=False, steps=(1, 2))
    for report in reports:
        assert report.committed and report.selector is Selector.TARGET
        assert report.draft_guard == "draft unchanged" and report.engines[0].draft_guard == "draft unchanged"
        assert report.engines[0].draft_digests is not None
    assert before == after and held == {}


def test_a_server_that_ignores_the_selector_is_caught_at_its_first_sync(reference_checkpoints, source, tmp_path):
    with engine(reference_checkpoints, tmp_path, finalize_policy="no_selector") as server:
        before, reports, held, after = run_syncs(server.url, source, inputs=FROZEN, include_mtp=False, steps=(3,))
    (report,) = reports
    assert not report.committed and report.selector is Selector.TARGET
    assert "draft model.layers.2." in report.error and "changed although the session selected target" in report.error
    assert "(draft guard)" in report.error, report.error
    assert list(held) == [server.url] and "verify" in held[server.url]
    # Held, not repaired or reset: the draft is the server's own re-shuffle of what it served before.
    assert set(after) == set(before) and after != before


def test_a_trained_draft_is_verified_as_the_target_and_not_guarded(reference_checkpoints, source, tmp_path):
    with engine(reference_checkpoints, tmp_path, finalize_policy="strict") as server:
        _, reports, held, _ = run_syncs(server.url, source, inputs=TRAINED, include_mtp=True, steps=(4,))
    (report,) = reports
    assert report.committed and report.selector is Selector.ALL and held == {}
    assert report.draft_guard == "" and report.verification in ("exact", "engine-exact")
