"""One sync session across every engine: the data flow of one sync as one function, `run_sync_session`.

    selector (cross-checked against every engine's draft report, before anything is sent)
    quantization (the sync's against every engine's, before anything is sent: miles_sync.sync.quantization)
    pause (barrier) -> flush (unless in_place, or the source flushes with its updates) -> [mechanism check:
        snapshot -> reset] -> begin(selector)
    source: export -> pack -> send, bucket by bucket (with `flushes_cache`, each update flushes the prefix cache)
    end -> update_weight_version -> [mechanism check: compare] -> verify (miles_sync.sync.verify: exact,
        engine-exact, or replica agreement)
    continue_generation for every engine that may serve, also on failure; in_place: flush after the resume

The session never raises for a failed sync: it returns a SyncReport with `committed` false, the error, and each
engine's result. On failure the source's transport is torn down first, so that no engine stays blocked in a
receive, and sessions left open are closed, so that the next sync can begin.

Failing closed: once the send has started, an engine on which the sync did not complete may hold partial weights.
Unless its checksum answer still equals its baseline (its answer when the last sync verified on it), it is
reported stale and left PAUSED: it gets no continue_generation, so it serves nothing, and its weights are never
written to quarantine it (the weights checker's reset action fills SGLang's with random values and keeps
serving). Engines the caller already holds paused (`held`) stay paused until a session verifies on them. Requests
queued on a held engine wait there (abort mode dropped them at the pause) and run once a verified sync resumes it.
A failure before the send (and before any mechanism-check reset) leaves every engine serving its old weights.
Committing the version is the caller's decision, made from the report.

Mechanism check (opt-in, `mechanism_check`; the controller asks for it on its first sync of a fleet at version 0
only): the weights checker snapshots the selected runners' weights, resets them to random values, and after the
sync compares them with the snapshot, bitwise, before the checksum verification. A parameter the sync never
writes keeps its random values and the compare names it. It proves the mechanism only when the source sends
exactly the weights the engines hold (the checkpoint they loaded at start): the caller promises that. A passed
check reports verification "mechanism+<method>" (per engine and fleet-wide; "mechanism" alone without `verify`).
Its snapshot and reset count in the report's pause phase, its compare in the verify phase.

Failing closed after a reset: once the reset step was sent, a session that does not complete (send, end,
version, compare or verify failed, or the session timed out) leaves EVERY engine it was sent to PAUSED, whatever
that engine answered: a reset that failed or timed out may still have run, and one that ran left random weights
that SGLang would serve. Their baselines are gone, so the intact check is skipped for them and could not resume
them anyway; even an engine that passed every step stays paused with the rest. Only a later sync that verifies
on an engine resumes it. A failed snapshot fails the session before any reset: the engines resume their old
weights.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from miles_sync.export.registry import ConversionMode
from miles_sync.sync.draft_guard import (
    DRAFT_UNCHANGED,
    DraftDigests,
    draft_changes,
    draft_digests,
    guards_draft,
    summarize_changes,
)
from miles_sync.sync.engine_digests import FleetLayouts, plan_engine_digests, read_model_config
from miles_sync.sync.frame import (
    FLUSHED_WITH_UPDATES,
    RESET_STEP,
    FleetSteps,
    PhaseClock,
    SessionError,
    SessionRun,
    SessionTimeouts,
    run_in_frame,
    session_report,
)
from miles_sync.sync.quantization import check_fleet_quantization
from miles_sync.sync.report import BucketProgress, SyncReport
from miles_sync.sync.selector import SelectorMode, resolve_selector
from miles_sync.sync.verify import DRAFT_GUARD, Verdict, sent_verdicts, weights_digest
from miles_sync.sync.weight_source import SendResult, WeightSource, flush_mode_problem
from miles_sync.transport.base import transport_spec
from miles_sync.weights.fp8 import Fp8Block
from miles_sync.wire.api import EngineAPI
from miles_sync.wire.protocol import (
    ChecksumNames,
    PauseMode,
    Role,
    Selector,
    WeightsCheckerAction,
    WeightsCheckerRequest,
    selector_roles,
)
from miles_sync.wire.text import raise_if

__all__ = ["SelectorInputs", "SessionTimeouts"]


@dataclass(frozen=True, kw_only=True)
class SelectorInputs:
    """What `resolve_selector` needs from the trainer side; the engine side comes from each draft report."""

    mode: SelectorMode
    speculative_algorithm: str | None
    num_trained_mtp_layers: int
    conversion_mode: ConversionMode
    # False skips the draft-coverage cross-check (a selected draft that the export cannot feed); only to
    # reproduce the frozen-draft bug of systems without it.
    check_coverage: bool = True


@dataclass(frozen=True, kw_only=True)
class EngineBaseline:
    """An engine's checksum answer, as one digest (miles_sync.sync.verify.weights_digest), when the last sync verified
    on it, for that sync's selector. A failed sync reads the answer again: equal means the send changed nothing."""

    selector: Selector
    digest: str


async def run_sync_session(
    *,
    engines: Sequence[EngineAPI],
    source: WeightSource,
    version: str,
    previous_version: str,
    selector_inputs: SelectorInputs,
    pause_mode: PauseMode,
    verify: bool,
    timeouts: SessionTimeouts,
    transport_name: str,
    on_bucket: Callable[[BucketProgress], None] | None = None,
    baselines: Mapping[str, EngineBaseline] | None = None,
    held: Collection[str] = (),
    staged: bool = False,
    mechanism_check: bool = False,
    quantization: Fp8Block | None = None,
    draft_baselines: Mapping[str, DraftDigests] | None = None,
    before_resume: Callable[[Sequence[str]], Awaitable[list[str]]] | None = None,
) -> SyncReport:
    """One session (module docstring). `baselines`: per engine, its checksum answer when the last sync verified on
    it; `held`: engines paused since an earlier failure; `draft_baselines`: per engine, its draft digests (the draft
    guard); `quantization`: what the source sends; `before_resume`: called with the engines that stay paused once
    the verdict is known and before any engine resumes (a router withdraws them: miles_sync.sync.routing), its
    warnings go into the report. Never raises for a failed sync: it is in the report."""
    fleet = FleetSteps(engines, timeout_s=timeouts.control_s, last_step=_last_step(verify, mechanism_check), held=held)
    clock, run = PhaseClock(), SessionRun()

    async def flow() -> None:
        await _sync(
            fleet,
            source=source,
            version=version,
            inputs=selector_inputs,
            pause_mode=pause_mode,
            verify=verify,
            staged=staged,
            mechanism_check=mechanism_check,
            clock=clock,
            run=run,
            on_bucket=on_bucket,
            quantization=quantization,
            draft_baselines=draft_baselines,
            loads_target_only=transport_spec(transport_name).sends_engine_parameters(),
        )

    await run_in_frame(
        fleet,
        flow=flow,
        run=run,
        clock=clock,
        sync_s=timeouts.sync_s,
        pause_mode=pause_mode,
        in_place_flush_s=timeouts.in_place_flush_s,
        after_failure=lambda: _abandon(fleet, source=source, selector=run.selector, baselines=baselines or {}),
        before_resume=before_resume,
    )
    return session_report(
        fleet,
        run,
        clock,
        version=version,
        previous_version=previous_version,
        transport=transport_name,
        is_checked=verify or mechanism_check,
    )


def _last_step(verify: bool, mechanism_check: bool) -> str:
    """The step an engine completes the session with: the checks it runs last, else the version."""
    return "verify" if verify else _COMPARE_STEP if mechanism_check else "version"


async def _sync(
    fleet: FleetSteps,
    *,
    source: WeightSource,
    version: str,
    inputs: SelectorInputs,
    pause_mode: PauseMode,
    verify: bool,
    staged: bool,
    mechanism_check: bool,
    clock: PhaseClock,
    run: SessionRun,
    on_bucket: Callable[[BucketProgress], None] | None,
    quantization: Fp8Block | None = None,
    draft_baselines: Mapping[str, DraftDigests] | None = None,
    loads_target_only: bool = False,
) -> None:
    draft_baselines = {} if draft_baselines is None else draft_baselines
    exported = await source.exported_names()  # once per session: a remote source asks every trainer rank
    run.selector = selector = await choose_selector(fleet.engines, exported_names=exported, inputs=inputs)
    if loads_target_only:
        await check_target_only(fleet.engines, selector=selector)
    await check_quantization(fleet.engines, exported_names=exported, quantization=quantization)
    t = fleet.timeout_s
    # Which engines' answers the source can predict (engine-exact), decided before the pause.
    layouts = await plan_engine_digests(fleet.engines, selector=selector, timeout_s=t) if verify else FleetLayouts()
    if staged:  # before the pause: the engines keep generating while the next version is exported, packed, hashed
        with clock.phase("stage"):
            await source.stage(selector=selector, engine_digests=layouts.plan)
    problem = flush_mode_problem(source, pause_mode=pause_mode)
    if problem is not None:
        raise ValueError(problem)
    with clock.phase("pause"):
        await fleet.step("pause", lambda e: e.pause_generation(pause_mode, timeout_s=t))
        # in_place keeps requests running: flushed after the resume. A source that flushes with its updates needs
        # no flush here (SenderSettings.flush_cache: SGLang's /flush_cache costs a gc pass on a CPU server).
        if pause_mode is not PauseMode.IN_PLACE and not source.flushes_cache:
            await fleet.flush_while_paused()
        if mechanism_check:
            await _snapshot_and_reset(fleet, selector=selector)
        await fleet.step("begin", lambda e: e.begin_weight_update(selector, timeout_s=t))
    with clock.phase("send"):
        fleet.attempted.add("send")  # from here on, an engine that does not complete may hold partial weights
        run.sent = await source.send(selector=selector, on_bucket=on_bucket, engine_digests=layouts.plan)
        if source.flushes_cache:  # every update to every engine succeeded, each flushing as it loaded
            for state in fleet.state.values():
                state.prefix_cache = FLUSHED_WITH_UPDATES
    with clock.phase("finalize"):
        await fleet.step("end", lambda e: e.end_weight_update(timeout_s=t))
        await fleet.step("version", lambda e: e.update_weight_version(version, timeout_s=t))
    with clock.phase("verify"):
        if mechanism_check:
            await _compare_to_snapshot(fleet, selector=selector)
        if verify:
            await _verify_fleet(
                fleet, sent=run.sent, selector=selector, layouts=layouts, draft_baselines=draft_baselines
            )


async def choose_selector(
    engines: Sequence[EngineAPI], *, exported_names: Sequence[str], inputs: SelectorInputs
) -> Selector:
    """resolve_selector against each engine's draft report and the export's names; all engines must agree.

    Raises ValueError before anything is sent when an engine's draft could receive none of its names, or when
    engines would need different selectors (one session carries one selector).
    """
    reports = await asyncio.gather(*(e.draft_report() for e in engines))
    exported = frozenset(exported_names)
    choices: dict[str, Selector] = {}
    problems = []
    for engine, report in zip(engines, reports):
        try:
            choices[engine.url] = resolve_selector(
                inputs.mode,
                speculative_algorithm=inputs.speculative_algorithm,
                num_trained_mtp_layers=inputs.num_trained_mtp_layers,
                conversion_mode=inputs.conversion_mode,
                draft=report,
                exported_names=exported if inputs.check_coverage else None,
            )
        except ValueError as exc:
            problems.append(f"{engine.url}: {exc}")
    raise_if(problems, what="selector cross-check failed, nothing was sent")
    if len(set(choices.values())) > 1:
        shown = ", ".join(f"{url}: {s.value}" for url, s in choices.items())
        raise ValueError(f"engines need different selectors ({shown}); one session carries one selector")
    return next(iter(choices.values()))


async def check_target_only(engines: Sequence[EngineAPI], *, selector: Selector) -> None:
    """Raise ValueError, before anything is sent, when `selector` covers an engine's draft runner and the transport
    sends the target's own parameters (shard_direct): a direct load goes to every selected runner, and a draft runner
    has none of those names (SGLang fails the load). A trained draft needs the colocated or distributed transport."""
    if Role.DRAFT not in selector_roles(selector):
        return
    reports = await asyncio.gather(*(e.draft_report() for e in engines))
    drafted = [e.url for e, r in zip(engines, reports) if r is not None and r.has_runner]
    raise_if(
        [f"{url}: selector {selector.value!r} covers its draft runner" for url in drafted],
        what=(
            "the shard_direct transport loads the target's own parameters into every selected runner; a session "
            "that updates a draft needs transport colocated or distributed"
        ),
    )


async def check_quantization(
    engines: Sequence[EngineAPI], *, exported_names: Sequence[str], quantization: Fp8Block | None
) -> None:
    """Raise ValueError, before anything is sent, when an engine serves another quantization than the sync sends
    (miles_sync.sync.quantization), naming the engine, a tensor and both dtypes."""
    paths = [None if e.info is None else e.info.model_path for e in engines]
    configs = await asyncio.gather(*(asyncio.to_thread(read_model_config, p) for p in paths))
    check_fleet_quantization(
        [(e.url, e.info, c) for e, c in zip(engines, configs)], quantization=quantization, exported_names=exported_names
    )


async def _snapshot_and_reset(fleet: FleetSteps, *, selector: Selector) -> None:
    """The mechanism check's set-up on every engine: snapshot the selected runners' weights, then reset them to
    random values. The reset step is recorded as attempted before any engine is called: from then on the engines
    stay paused unless the session completes (module docstring)."""
    snapshot = WeightsCheckerRequest(action=WeightsCheckerAction.SNAPSHOT, selector=selector)
    await fleet.step("mechanism-snapshot", lambda e: e.weights_checker(snapshot, timeout_s=fleet.timeout_s))
    reset = WeightsCheckerRequest(action=WeightsCheckerAction.RESET_TENSORS, selector=selector)
    await fleet.step(RESET_STEP, lambda e: e.weights_checker(reset, timeout_s=fleet.timeout_s))


async def _compare_to_snapshot(fleet: FleetSteps, *, selector: Selector) -> None:
    """The mechanism check's verdict: every selected weight equals its snapshot again, bitwise. The engine's
    answer names each parameter that differs (one the sync never wrote keeps its random values)."""
    compare = WeightsCheckerRequest(action=WeightsCheckerAction.COMPARE, selector=selector)
    try:
        await fleet.step(_COMPARE_STEP, lambda e: e.weights_checker(compare, timeout_s=fleet.timeout_s))
    finally:
        for state in fleet.state.values():
            if _COMPARE_STEP in state.done:
                state.checks.append("mechanism")


async def _verify_fleet(
    fleet: FleetSteps,
    *,
    sent: SendResult,
    selector: Selector,
    layouts: FleetLayouts,
    draft_baselines: Mapping[str, DraftDigests],
) -> None:
    """Each engine passes the strongest check its checksum answer allows (miles_sync.sync.verify.fleet_verdicts)
    and, when the session left its draft out, the draft guard (miles_sync.sync.draft_guard): its draft digests
    must equal `draft_baselines`. Raises SessionError naming the engine and tensors (engine-exact: rank, role and
    parameter) of every failure."""
    guarded = set(draft_baselines) if guards_draft(selector) else set()
    request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=selector)
    # The guard reads the draft in the same checker call: selector all for the engines whose draft it guards.
    with_draft = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.ALL)
    results = await fleet.step(
        "verify-checksum",
        lambda e: e.weights_checker(with_draft if e.url in guarded else request, timeout_s=fleet.timeout_s),
    )
    answers = {e.url: r.ranks for e, r in zip(fleet.engines, results)}
    verdicts = sent_verdicts(
        answers=answers,
        selector=selector,
        checksums=sent.checksums,
        engine_checksums=sent.engine_checksums,
        layouts=layouts,
        hf_named=hf_named_urls(fleet.engines),
        sent_names=sent.sent_names(),
    )
    failures = []
    for engine in fleet.engines:
        verdict, state = verdicts[engine.url], fleet.state[engine.url]
        state.num_verified = verdict.num_verified
        state.draft = draft_digests(answers[engine.url])
        if verdict.passed and engine.url in guarded:
            changes = draft_changes(baseline=draft_baselines[engine.url], current=state.draft, selector=selector)
            if changes:
                verdict = Verdict(passed=False, method=DRAFT_GUARD, message=summarize_changes(changes))
        if verdict.passed:
            state.done.add("verify")
            state.checks.append(verdict.method)
            state.draft_guard = DRAFT_UNCHANGED if engine.url in guarded else ""
            state.digest = weights_digest(answers[engine.url], selector=selector)
        else:
            fleet.fail(engine.url, "verify", verdict.message)
            failures.append(f"{engine.url} ({verdict.method}): {verdict.message}")
    if failures:
        raise SessionError("verification failed: " + " | ".join(failures))


def hf_named_urls(engines: Sequence[EngineAPI]) -> set[str]:
    """The engines whose checker answers HF-named digests (the exact check). What connect() learned; an engine
    never probed is assumed to answer as SGLang does (engine names)."""
    return {e.url for e in engines if e.info is not None and e.info.miles_sync_checksum_names is ChecksumNames.HF}


async def _abandon(
    fleet: FleetSteps, *, source: WeightSource, selector: Selector | None, baselines: Mapping[str, EngineBaseline]
) -> None:
    """After a failure: tear down the source's transport first (an engine blocked in a receive then fails fast and
    releases its weight lock), close every session left open so that the next begin succeeds, then find the
    engines that still answer their baseline checksums (the send changed nothing on them: they may serve again).
    Every other engine the send may have reached stays paused (see the module docstring); nothing is written to
    any engine's weights."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(source.close(), timeout=fleet.timeout_s)
    if "begin" in fleet.attempted and "end" not in fleet.attempted:
        # The engine closes its session even when end reports a failure (e.g. a runner that loaded nothing).
        with contextlib.suppress(SessionError):
            await fleet.step("end-after-failure", lambda e: e.end_weight_update(timeout_s=fleet.timeout_s))
    # A reset engine's baseline is gone: it stays paused whatever it answers now.
    if fleet.may_hold_random_weights:
        return
    partial = [e for e in fleet.engines if fleet.may_hold_partial_weights(e.url)]
    if partial and selector is not None:
        await _mark_intact(fleet, partial, baselines=baselines, selector=selector)


async def _mark_intact(
    fleet: FleetSteps, engines: Sequence[EngineAPI], *, baselines: Mapping[str, EngineBaseline], selector: Selector
) -> None:
    """Mark intact the engines among `engines` whose checksum answer for `selector`'s roles still equals their
    baseline; the others (no baseline, another selector, different, or no answer) stay possibly partial."""
    request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=selector)

    async def is_intact(engine: EngineAPI) -> bool:
        baseline = baselines.get(engine.url)
        if baseline is None or baseline.selector != selector:
            return False
        try:
            result = await engine.weights_checker(request, timeout_s=fleet.timeout_s)
        except Exception:  # unreachable or refusing: its state is unknown, so it is treated as partial
            return False
        return weights_digest(result.ranks, selector=selector) == baseline.digest

    verdicts = await asyncio.gather(*(is_intact(e) for e in engines))
    for engine, intact in zip(engines, verdicts):
        fleet.state[engine.url].is_intact = intact


_COMPARE_STEP = "mechanism-compare"
