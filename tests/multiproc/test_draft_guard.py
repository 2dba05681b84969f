"""The frozen-draft guard against reference engines: one that honours the selector (the guard passes and says so)
and one that ignores it as a server without selector support does (`--finalize-policy no_selector`: every runner in
every session, every runner post-processed at its end, the AITER shuffle applied to the frozen draft once more).
The guard must catch the second at its first sync, name the draft parameter, and hold the engine with the shuffled
draft as it is (never written to); at TP=2 it compares every rank's draft digests.

The acceptance canary (miles_sync.sync.draft_canary) on the same engines: it passes on correct syncs, and flags the
AITER double shuffle of a frozen draft that a session selected (`all` with the coverage check off, SGLang's
finalize), which no digest check sees because verification of such a session is off in the systems that have the
bug; in hold mode the engine is paused again and held, its weights untouched."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
from reference_server import reference_server
from sender_host import SenderSettings

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.job.rl import make_prompts
from miles_sync.sync.controller import SyncController
from miles_sync.sync.draft_canary import CanaryMode, CanarySettings, canary_requests
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.wire.protocol import PauseMode, Selector, WeightsCheckerAction, WeightsCheckerRequest

# Slow: 101 s on a clean clone at 2d21038 (engines started per test or per TP size); the quick loop skips it.
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

TIMEOUTS = SessionTimeouts(control_s=20.0, sync_s=90.0)
FROZEN = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
TRAINED = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=1, conversion_mode=ConversionMode.RAW
)
# The seed bug's session: `all` although the draft is frozen, with the check that would refuse it off.
FROZEN_SELECTED = SelectorInputs(
    mode=SelectorMode.ALL,
    speculative_algorithm="mtp",
    num_trained_mtp_layers=0,
    conversion_mode=ConversionMode.RAW,
    check_coverage=False,
)
PROMPTS = tuple(tuple(p) for p in make_prompts(0, num_prompts=4, length=4))


@contextlib.contextmanager
def engine(checkpoints, log_dir, *, finalize_policy: str, tp: int = 1):
    with reference_server(
        model=checkpoints / "target",
        log_dir=log_dir,
        draft_kind="mtp",
        weight_layout="aiter",
        finalize_policy=finalize_policy,
        extra_args=("--collective-timeout-s", "15", "--tp-size", str(tp)),
    ) as server:
        yield server


async def draft_checksums(url: str) -> list[dict[str, str]]:
    """Every TP rank's draft digests, in the checker's rank order."""
    async with EngineClient(url, timeout_s=20.0) as client:
        answer = await client.weights_checker(
            WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.DRAFT)
        )
    return [dict(rank.checksums) for rank in answer.ranks]


async def is_paused(url: str) -> bool:
    """A generation request on a paused engine waits in its queue: it does not finish within a few seconds."""
    async with EngineClient(url, timeout_s=20.0) as client:
        try:
            await asyncio.wait_for(client.generate(canary_requests(CANARY_WARN)[0]), timeout=3.0)
        except TimeoutError:
            return True
    return False


CANARY_WARN = CanarySettings(mode=CanaryMode.WARN, prompts=PROMPTS)
CANARY_HOLD = CanarySettings(mode=CanaryMode.HOLD, prompts=PROMPTS)


def run_syncs(
    url: str,
    source,
    *,
    inputs: SelectorInputs,
    include_mtp: bool,
    steps: tuple[int, ...],
    verify: bool = True,
    canary: CanarySettings | None = None,
):
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
            verify=verify,
            timeouts=TIMEOUTS,
            show_progress=False,
            draft_canary=canary,
        )
        await ctl.connect()
        reports = []
        try:
            for step in steps:
                await source.call("step", step)
                reports.append(await ctl.sync(raise_on_failure=False))
            held = dict(ctl.held_engines)
            paused = await is_paused(url)
        finally:
            await ctl.close()
        return Run(before=before, reports=reports, held=held, after=await draft_checksums(url), paused=paused)

    return asyncio.run(main())


@dataclasses.dataclass(frozen=True)
class Run:
    before: list[dict[str, str]]  # the draft's digests per rank before the controller connected
    reports: list
    held: dict[str, str]
    after: list[dict[str, str]]  # and after the last sync
    paused: bool  # the engine was paused after the last sync


@pytest.mark.parametrize("tp", [1, 2])
def test_the_guard_passes_and_says_so_when_the_selector_is_honoured(reference_checkpoints, source, tmp_path, tp):
    with engine(reference_checkpoints, tmp_path, finalize_policy="sglang", tp=tp) as server:
        run = run_syncs(server.url, source, inputs=FROZEN, include_mtp=False, steps=(1, 2), canary=CANARY_WARN)
    for report in run.reports:
        assert report.committed and report.selector is Selector.TARGET
        assert report.draft_guard == "draft unchanged" and report.engines[0].draft_guard == "draft unchanged"
        assert len(report.engines[0].draft_digests) == tp and all(report.engines[0].draft_digests)
        # The canary measured the draft and found it working: no finding, nothing held.
        (reading,) = report.canary
        assert reading.accept_length > 1.5 and not reading.flagged and report.warnings == ()
    assert len(run.before) == tp and run.before == run.after and run.held == {} and not run.paused


@pytest.mark.parametrize("tp", [1, 2])
def test_a_server_that_ignores_the_selector_is_caught_at_its_first_sync(reference_checkpoints, source, tmp_path, tp):
    with engine(reference_checkpoints, tmp_path, finalize_policy="no_selector", tp=tp) as server:
        run = run_syncs(server.url, source, inputs=FROZEN, include_mtp=False, steps=(3,))
    (report,) = run.reports
    assert not report.committed and report.selector is Selector.TARGET
    assert "draft model.layers.2." in report.error and "changed although the session selected target" in report.error
    assert "(draft guard)" in report.error, report.error
    if tp == 2:  # every rank's shard of the draft was compared, and the message says which rank's changed
        assert "rank 0 draft model.layers.2." in report.error or "rank 1 draft model.layers.2." in report.error
    assert list(run.held) == [server.url] and "verify" in run.held[server.url] and run.paused
    # Held, not repaired or reset: the draft is the server's own re-shuffle of what it served before.
    assert [set(r) for r in run.after] == [set(r) for r in run.before] and run.after != run.before


def test_a_trained_draft_is_verified_as_the_target_and_not_guarded(reference_checkpoints, source, tmp_path):
    with engine(reference_checkpoints, tmp_path, finalize_policy="strict") as server:
        run = run_syncs(server.url, source, inputs=TRAINED, include_mtp=True, steps=(4,))
    (report,) = run.reports
    assert report.committed and report.selector is Selector.ALL and run.held == {}
    assert report.draft_guard == "" and report.verification in ("exact", "engine-exact (sha256)")


def test_the_canary_flags_the_double_shuffle_and_holds_the_engine(reference_checkpoints, source, tmp_path):
    """The seed bug itself (a frozen draft in the session, SGLang's finalize shuffling it again) with verification
    off, as in systems that have it: only the canary sees the draft stop accepting."""
    with engine(reference_checkpoints, tmp_path, finalize_policy="sglang") as server:
        run = run_syncs(
            server.url,
            source,
            inputs=FROZEN_SELECTED,
            include_mtp=False,
            steps=(5,),
            verify=False,
            canary=CANARY_HOLD,
        )
    (report,) = run.reports
    assert report.committed and report.selector is Selector.ALL and report.canary_flagged == (server.url,)
    (reading,) = report.canary
    assert reading.accept_length < 0.5 * reading.baseline and reading.baseline > 2.0, reading
    assert any("draft canary accept length" in w and "below 0.5 x its baseline" in w for w in report.warnings)
    assert list(run.held) == [server.url] and "draft canary" in run.held[server.url] and run.paused
    # The canary reads and pauses; the weights it holds are the engine's own double shuffle, never written to.
    assert run.after != run.before
