"""One sync session across every engine: the data flow of one sync as one function, `run_sync_session`.

    selector (cross-checked against every engine's draft report, before anything is sent)
    quantization (the sync's against every engine's, before anything is sent: miles_sync.sync.quantization)
    pause (barrier) -> flush (unless in_place) -> [mechanism check: snapshot -> reset] -> begin(selector)
    source: export -> pack -> send, bucket by bucket
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
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

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
from miles_sync.sync.quantization import check_fleet_quantization
from miles_sync.sync.report import BucketProgress, EngineResult, PhaseTimes, SyncReport
from miles_sync.sync.selector import SelectorMode, resolve_selector
from miles_sync.sync.verify import DRAFT_GUARD, Verdict, fleet_verdicts, weights_digest
from miles_sync.sync.weight_source import SendResult, WeightSource
from miles_sync.weights.fp8 import Fp8Block
from miles_sync.wire.api import EngineAPI
from miles_sync.wire.protocol import ChecksumNames, PauseMode, Selector, WeightsCheckerAction, WeightsCheckerRequest

__all__ = [
    "EngineBaseline",
    "SelectorInputs",
    "SessionError",
    "SessionTimeouts",
    "choose_selector",
    "run_sync_session",
]


class SessionError(RuntimeError):
    """A step of the session failed on at least one engine; the message names the step, engines and causes."""


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
class SessionTimeouts:
    """`control_s` bounds each control call to one engine; `sync_s` the whole session from the selector to the
    verification (the resume that follows gets its own `control_s`)."""

    control_s: float
    sync_s: float

    def __post_init__(self) -> None:
        bad = [f"{n}={v}" for n, v in (("control_s", self.control_s), ("sync_s", self.sync_s)) if not v > 0]
        if bad:
            raise ValueError(f"session timeouts must be positive: {', '.join(bad)}")


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
) -> SyncReport:
    """Run one session: see the module docstring. `quantization`: what the source sends (block FP8 or None), checked
    against each engine's before the pause. `baselines`: per engine URL, what the last verified sync left
    (absent: the engine is treated as partial after any failed send). `held`: URLs of engines kept paused since an
    earlier failure; they are resumed only by a session that completes on them. `mechanism_check`: snapshot, reset,
    sync, compare (module docstring); only when the source sends exactly the weights every engine holds, else the
    compare fails and every engine stays paused. `draft_baselines`: per engine URL, its draft digests before the
    session (miles_sync.sync.draft_guard); a session that leaves the draft out fails on an engine whose draft
    changed. Mutates the engines' weights and version; never raises for a
    failed sync (it is in the report), only for programming errors."""
    last_step = "verify" if verify else _COMPARE_STEP if mechanism_check else "version"
    fleet = _FleetSteps(engines, timeout_s=timeouts.control_s, last_step=last_step, held=held)
    clock = _PhaseClock()
    run = _Run()
    start = time.perf_counter()
    try:
        await asyncio.wait_for(
            _sync(
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
            ),
            timeout=timeouts.sync_s,
        )
    except Exception as exc:  # every failure of a step ends here and goes into the report
        # wait_for's own timeout carries no message; every step's errors do.
        run.error = str(exc) or f"{type(exc).__name__}: the sync did not finish within {timeouts.sync_s} s"
        await _abandon(fleet, source=source, selector=run.selector, baselines=baselines or {})
    finally:
        with clock.phase("resume"):
            await fleet.resume()
            if pause_mode is PauseMode.IN_PLACE:
                run.warnings.extend(await fleet.flush_after_in_place_resume())
    return _report(
        fleet,
        run,
        clock,
        version=version,
        previous_version=previous_version,
        transport_name=transport_name,
        is_checked=verify or mechanism_check,
        total_s=time.perf_counter() - start,
    )


async def _sync(
    fleet: _FleetSteps,
    *,
    source: WeightSource,
    version: str,
    inputs: SelectorInputs,
    pause_mode: PauseMode,
    verify: bool,
    staged: bool,
    mechanism_check: bool,
    clock: _PhaseClock,
    run: _Run,
    on_bucket: Callable[[BucketProgress], None] | None,
    quantization: Fp8Block | None = None,
    draft_baselines: Mapping[str, DraftDigests] | None = None,
) -> None:
    draft_baselines = {} if draft_baselines is None else draft_baselines
    run.selector = selector = await choose_selector(fleet.engines, source=source, inputs=inputs)
    await check_quantization(fleet.engines, source=source, quantization=quantization)
    t = fleet.timeout_s
    # Which engines' answers the source can predict (engine-exact), decided before the pause.
    layouts = await plan_engine_digests(fleet.engines, selector=selector, timeout_s=t) if verify else FleetLayouts()
    if staged:  # before the pause: the engines keep generating while the next version is exported, packed, hashed
        with clock.phase("stage"):
            await source.stage(selector=selector, engine_digests=layouts.plan)
    with clock.phase("pause"):
        await fleet.step("pause", lambda e: e.pause_generation(pause_mode, timeout_s=t))
        if pause_mode is not PauseMode.IN_PLACE:  # in_place keeps requests running: flushed after the resume
            await fleet.step("flush", lambda e: e.flush_cache(timeout_s=t))
        if mechanism_check:
            await _snapshot_and_reset(fleet, selector=selector)
        await fleet.step("begin", lambda e: e.begin_weight_update(selector, timeout_s=t))
    with clock.phase("send"):
        fleet.attempted.add("send")  # from here on, an engine that does not complete may hold partial weights
        run.sent = await source.send(selector=selector, on_bucket=on_bucket, engine_digests=layouts.plan)
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
    fleet.is_complete = True


async def choose_selector(engines: Sequence[EngineAPI], *, source: WeightSource, inputs: SelectorInputs) -> Selector:
    """resolve_selector against each engine's draft report and the export's names; all engines must agree.

    Raises ValueError before anything is sent when an engine's draft could receive none of its names, or when
    engines would need different selectors (one session carries one selector).
    """
    names, reports = await asyncio.gather(source.exported_names(), asyncio.gather(*(e.draft_report() for e in engines)))
    exported = frozenset(names)
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
    if problems:
        raise ValueError("selector cross-check failed, nothing was sent: " + "; ".join(problems))
    if len(set(choices.values())) > 1:
        shown = ", ".join(f"{url}: {s.value}" for url, s in choices.items())
        raise ValueError(f"engines need different selectors ({shown}); one session carries one selector")
    return next(iter(choices.values()))


async def check_quantization(
    engines: Sequence[EngineAPI], *, source: WeightSource, quantization: Fp8Block | None
) -> None:
    """Raise ValueError, before anything is sent, when an engine serves another quantization than the sync sends
    (miles_sync.sync.quantization), naming the engine, a tensor and both dtypes."""
    names = await source.exported_names()
    paths = [None if e.info is None else e.info.model_path for e in engines]
    configs = await asyncio.gather(*(asyncio.to_thread(read_model_config, p) for p in paths))
    check_fleet_quantization(
        [(e.url, e.info, c) for e, c in zip(engines, configs)], quantization=quantization, exported_names=names
    )


async def _snapshot_and_reset(fleet: _FleetSteps, *, selector: Selector) -> None:
    """The mechanism check's set-up on every engine: snapshot the selected runners' weights, then reset them to
    random values. The reset step is recorded as attempted before any engine is called: from then on the engines
    stay paused unless the session completes (module docstring)."""
    snapshot = WeightsCheckerRequest(action=WeightsCheckerAction.SNAPSHOT, selector=selector)
    await fleet.step("mechanism-snapshot", lambda e: e.weights_checker(snapshot, timeout_s=fleet.timeout_s))
    reset = WeightsCheckerRequest(action=WeightsCheckerAction.RESET_TENSORS, selector=selector)
    await fleet.step(_RESET_STEP, lambda e: e.weights_checker(reset, timeout_s=fleet.timeout_s))


async def _compare_to_snapshot(fleet: _FleetSteps, *, selector: Selector) -> None:
    """The mechanism check's verdict: every selected weight equals its snapshot again, bitwise. The engine's
    answer names each parameter that differs (one the sync never wrote keeps its random values)."""
    compare = WeightsCheckerRequest(action=WeightsCheckerAction.COMPARE, selector=selector)
    await fleet.step(_COMPARE_STEP, lambda e: e.weights_checker(compare, timeout_s=fleet.timeout_s))


async def _verify_fleet(
    fleet: _FleetSteps,
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
    predicted = {
        url: sent.engine_checksums[layout] for url, layout in layouts.by_url.items() if layout in sent.engine_checksums
    }
    unpredicted = {url: "the source sent no digests for its layout" for url in layouts.by_url if url not in predicted}
    verdicts = fleet_verdicts(
        answers=answers,
        selector=selector,
        sent=sent.checksums,
        hf_named={e.url for e in fleet.engines if _checksum_names(e) is ChecksumNames.HF},
        predicted=predicted,
        fallbacks={**layouts.fallbacks, **unpredicted},
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
            state.verification = verdict.method
            state.draft_guard = DRAFT_UNCHANGED if engine.url in guarded else ""
            state.digest = weights_digest(answers[engine.url], selector=selector)
        else:
            fleet.fail(engine.url, "verify", verdict.message)
            failures.append(f"{engine.url} ({verdict.method}): {verdict.message}")
    if failures:
        raise SessionError("verification failed: " + " | ".join(failures))


def _checksum_names(engine: EngineAPI) -> ChecksumNames:
    # What connect() learned; an engine never probed is assumed to answer as SGLang does.
    return ChecksumNames.ENGINE if engine.info is None else engine.info.miles_sync_checksum_names


async def _abandon(
    fleet: _FleetSteps, *, source: WeightSource, selector: Selector | None, baselines: Mapping[str, EngineBaseline]
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
    partial = [e for e in fleet.engines if fleet.may_hold_partial_weights(e.url) and not fleet.is_reset(e.url)]
    if partial and selector is not None:
        await _mark_intact(fleet, partial, baselines=baselines, selector=selector)


async def _mark_intact(
    fleet: _FleetSteps, engines: Sequence[EngineAPI], *, baselines: Mapping[str, EngineBaseline], selector: Selector
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


@dataclass(kw_only=True)
class _EngineState:
    done: set[str] = field(default_factory=set)  # steps that succeeded on this engine
    message: str = ""  # the first failure, if any
    num_verified: int = 0
    verification: str = ""  # the check that passed on it
    digest: str | None = None  # its verified checksum answer, as one digest
    draft: tuple[dict[str, str], ...] | None = None  # its draft digests as the verification read them
    draft_guard: str = ""  # DRAFT_UNCHANGED when the draft guard ran on it and passed
    is_intact: bool = False  # checked after a failed send: still answers its baseline checksums


class _FleetSteps:
    """Runs one step on every engine concurrently and records, per engine, what succeeded and the first failure."""

    def __init__(
        self, engines: Sequence[EngineAPI], *, timeout_s: float, last_step: str, held: Collection[str]
    ) -> None:
        self.engines = tuple(engines)
        self.timeout_s = timeout_s
        self.last_step = last_step  # an engine succeeded when it got through this step
        self.held = frozenset(held)
        self.state = {e.url: _EngineState() for e in self.engines}
        self.attempted: set[str] = set()
        self.is_complete = False  # every step of the session succeeded on every engine

    async def step(
        self,
        name: str,
        call: Callable[[EngineAPI], Awaitable[object]],
        *,
        only: Sequence[EngineAPI] | None = None,
    ) -> list:
        """Run `call` on every engine (or those in `only`) concurrently; SessionError if any failed."""
        engines = self.engines if only is None else tuple(only)
        self.attempted.add(name)  # before the calls: a call that times out may still have taken effect
        results = await asyncio.gather(*(call(e) for e in engines), return_exceptions=True)
        failures = []
        for engine, result in zip(engines, results):
            if isinstance(result, BaseException):
                self.fail(engine.url, name, str(result))
                failures.append(f"{engine.url}: {result}")
            else:
                self.state[engine.url].done.add(name)
        if failures:
            raise SessionError(f"{name} failed on {len(failures)} of {len(engines)} engine(s): " + "; ".join(failures))
        return list(results)

    def fail(self, url: str, step: str, message: str) -> None:
        state = self.state[url]
        if not state.message:
            state.message = f"{step}: {message}"

    async def resume(self) -> None:
        """continue_generation on every engine a pause was sent to that may serve, whatever happened since;
        failures are recorded per engine and never raised (this runs in `finally`). A stale engine stays paused."""
        serving = [e for e in self.engines if not self.is_stale(e.url)]
        if "pause" in self.attempted and serving:
            with contextlib.suppress(SessionError):
                await self.step("resume", lambda e: e.continue_generation(timeout_s=self.timeout_s), only=serving)

    async def flush_after_in_place_resume(self) -> list[str]:
        """An in_place pause keeps requests running, and SGLang refuses to flush its prefix cache while any runs,
        so the cache is flushed once they let it (the client retries while the engine answers 400), within
        `timeout_s`. Until then cached prefixes computed with the old weights may be reused. Returns a warning per
        engine that could not be flushed; never raises."""
        engines = [e for e in self.engines if "resume" in self.state[e.url].done and "send" in self.attempted]

        async def flush(engine: EngineAPI) -> str | None:
            try:
                await asyncio.wait_for(engine.flush_cache(timeout_s=self.timeout_s), timeout=self.timeout_s)
            except Exception as exc:
                return f"{engine.url}: prefix cache not flushed after the in_place resume: {exc or 'timed out'}"
            return None

        return [w for w in await asyncio.gather(*(flush(e) for e in engines)) if w is not None]

    def may_hold_partial_weights(self, url: str) -> bool:
        # Bytes may have reached this engine, it did not get through the sync's last step, and no check after the
        # failure found it unchanged.
        state = self.state[url]
        return "send" in self.attempted and self.last_step not in state.done and not state.is_intact

    def is_reset(self, url: str) -> bool:
        # The mechanism check's reset was sent to it (it may have run even where the call failed or timed out) and
        # the session did not complete: it may hold random weights.
        return _RESET_STEP in self.attempted and not self.is_complete

    def is_stale(self, url: str) -> bool:
        """Must stay paused: it may hold partial weights from this session, or random ones from its mechanism
        check, or was held from an earlier one and this session did not complete on it."""
        completed = self.last_step in self.state[url].done
        return self.may_hold_partial_weights(url) or self.is_reset(url) or (url in self.held and not completed)


@dataclass(kw_only=True)
class _Run:
    selector: Selector | None = None
    sent: SendResult | None = None
    error: str | None = None
    warnings: list[str] = field(default_factory=list)


class _PhaseClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def _report(
    fleet: _FleetSteps,
    run: _Run,
    clock: _PhaseClock,
    *,
    version: str,
    previous_version: str,
    transport_name: str,
    is_checked: bool,
    total_s: float,
) -> SyncReport:
    sent, s = run.sent, clock.seconds
    engines = tuple(
        EngineResult(
            url=url,
            success=fleet.last_step in state.done,
            is_stale=fleet.is_stale(url),
            num_verified_tensors=state.num_verified,
            weight_version=version if "version" in state.done else None,
            message=_engine_message(fleet, url),
            verification=_verification(is_mechanism_checked=_COMPARE_STEP in state.done, method=state.verification),
            weights_digest=state.digest,
            draft_digests=state.draft if "verify" in state.done else None,
            draft_guard=state.draft_guard,
        )
        for url, state in fleet.state.items()
    )
    methods = sorted({state.verification for state in fleet.state.values() if state.verification})
    is_mechanism_checked = any(_COMPARE_STEP in state.done for state in fleet.state.values())
    verification = _verification(is_mechanism_checked=is_mechanism_checked, method="+".join(methods))
    return SyncReport(
        version=version,
        previous_version=previous_version,
        committed=fleet.is_complete,
        selector=run.selector,
        transport=transport_name,
        num_bytes=0 if sent is None else sent.num_bytes,
        num_buckets=0 if sent is None else sent.num_buckets,
        num_tensors=0 if sent is None else sent.num_tensors,
        phases=PhaseTimes(
            stage_s=s.get("stage", 0.0),
            pause_s=s.get("pause", 0.0),
            export_s=0.0 if sent is None else sent.export_s,
            send_s=s.get("send", 0.0),
            finalize_s=s.get("finalize", 0.0),
            verify_s=s.get("verify", 0.0),
            resume_s=s.get("resume", 0.0),
        ),
        total_s=total_s,
        engines=engines,
        error=run.error,
        checksums={} if sent is None else dict(sent.checksums),
        verification=verification if is_checked else "off",
        warnings=tuple(run.warnings),
    )


def _verification(*, is_mechanism_checked: bool, method: str) -> str:
    return "+".join(part for part in ("mechanism" if is_mechanism_checked else "", method) if part)


def _engine_message(fleet: _FleetSteps, url: str) -> str:
    message = fleet.state[url].message
    if fleet.is_reset(url):  # whatever failed first, the reset is why it stays paused
        return "; ".join(m for m in (message, _RESET_MESSAGE) if m)
    return message or (_HELD_MESSAGE if fleet.is_stale(url) else "")


_RESET_STEP = "mechanism-reset"
_COMPARE_STEP = "mechanism-compare"
_HELD_MESSAGE = "held paused since an earlier failed sync: may hold partial weights"
_RESET_MESSAGE = "held paused: the mechanism check reset its weights to random values and the sync did not complete"
