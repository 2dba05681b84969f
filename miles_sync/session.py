"""One sync session across every engine: DESIGN.md section 5 as one function, `run_sync_session`.

    selector (cross-checked against every engine's draft report, before anything is sent)
    pause (barrier) -> flush (unless in_place) -> begin(selector)
    source: export -> pack -> send, bucket by bucket
    end -> update_weight_version -> verify (trainer checksums == every engine's, for the selected roles)
    continue_generation for every engine that was paused, also on failure

The session never raises for a failed sync: it returns a SyncReport with `committed` false, the error, and each
engine's result. On failure the source's transport is torn down first, so that no engine stays blocked in a
receive, and sessions left open are closed, so that the next sync can begin. Once the send has started, an engine
on which the sync did not complete may hold partial weights: unless its checksums show it still holds the committed
version, it is reported stale and quarantined, so that it refuses /generate until a later full sync (see
`_abandon`); a failure before the send leaves every engine serving its old weights. Committing the version is the caller's decision, made from the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from miles_sync.checksum import DRAFT_PREFIX, compare_checksums
from miles_sync.engine.client import EngineClient
from miles_sync.protocol import (
    PauseMode,
    RankChecksums,
    Role,
    Selector,
    WeightsCheckerAction,
    WeightsCheckerRequest,
    selector_roles,
)
from miles_sync.report import BucketProgress, EngineResult, PhaseTimes, SyncReport
from miles_sync.selector import ConversionMode, SelectorMode, resolve_selector
from miles_sync.sender import SendResult, WeightSource

__all__ = [
    "SelectorInputs",
    "SessionError",
    "SessionTimeouts",
    "checksum_problems",
    "choose_selector",
    "run_sync_session",
]

_NUM_PROBLEMS_SHOWN = 6


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


async def run_sync_session(
    *,
    engines: Sequence[EngineClient],
    source: WeightSource,
    version: str,
    previous_version: str,
    selector_inputs: SelectorInputs,
    pause_mode: PauseMode,
    verify: bool,
    timeouts: SessionTimeouts,
    transport_name: str,
    on_bucket: Callable[[BucketProgress], None] | None = None,
    committed_checksums: Mapping[str, str] | None = None,
    staged: bool = False,
) -> SyncReport:
    """Run one session: see the module docstring. `committed_checksums`: the checksums of the version the engines
    serve (the last committed report's), used after a failed send to tell engines that still hold it intact from
    engines that may hold partial weights; None (nothing committed yet) treats every engine as possibly partial. Mutates the engines' weights and version; never raises for a
    failed sync (it is in the report), only for programming errors outside the session's steps."""
    fleet = _Fleet(engines, timeout_s=timeouts.control_s, last_step="verify" if verify else "version")
    clock = _PhaseClock()
    run = _Run()
    start = time.perf_counter()
    try:
        await asyncio.wait_for(
            _sync(fleet, source=source, version=version, inputs=selector_inputs, pause_mode=pause_mode,
                  verify=verify, staged=staged, clock=clock, run=run, on_bucket=on_bucket),
            timeout=timeouts.sync_s,
        )  # fmt: skip
    except Exception as exc:  # every failure of a step ends here and goes into the report
        # wait_for's own timeout carries no message; every step's errors do.
        run.error = str(exc) or f"{type(exc).__name__}: the sync did not finish within {timeouts.sync_s} s"
        await _abandon(fleet, source=source, selector=run.selector, committed=committed_checksums)
    finally:
        with clock.phase("resume"):
            await fleet.resume()
    return _report(fleet, run, clock, version=version, previous_version=previous_version,
                   transport_name=transport_name, total_s=time.perf_counter() - start)  # fmt: skip


async def _sync(
    fleet: _Fleet,
    *,
    source: WeightSource,
    version: str,
    inputs: SelectorInputs,
    pause_mode: PauseMode,
    verify: bool,
    staged: bool,
    clock: _PhaseClock,
    run: _Run,
    on_bucket: Callable[[BucketProgress], None] | None,
) -> None:
    run.selector = selector = await choose_selector(fleet.engines, source=source, inputs=inputs)
    t = fleet.timeout_s
    if staged:  # before the pause: the engines keep generating while the next version is exported and packed
        with clock.phase("stage"):
            await source.stage()
    with clock.phase("pause"):
        await fleet.step("pause", lambda e: e.pause_generation(pause_mode, timeout_s=t))
        if pause_mode is not PauseMode.IN_PLACE:  # in_place keeps requests running; the engine invalidates instead
            await fleet.step("flush", lambda e: e.flush_cache(timeout_s=t))
        await fleet.step("begin", lambda e: e.begin_weight_update(selector, timeout_s=t))
    with clock.phase("send"):
        fleet.attempted.add("send")  # from here on, an engine that does not complete may hold partial weights
        run.sent = await source.send(selector=selector, on_bucket=on_bucket)
    with clock.phase("finalize"):
        await fleet.step("end", lambda e: e.end_weight_update(timeout_s=t))
        await fleet.step("version", lambda e: e.update_weight_version(version, timeout_s=t))
    with clock.phase("verify"):
        if verify:
            await _verify_fleet(fleet, sent=run.sent.checksums, selector=selector)
    run.is_complete = True


async def choose_selector(
    engines: Sequence[EngineClient], *, source: WeightSource, inputs: SelectorInputs
) -> Selector:
    """resolve_selector against each engine's draft report and the export's names; all engines must agree.

    Raises ValueError before anything is sent when an engine's draft could receive none of its names, or when
    engines would need different selectors (one session carries one selector).
    """
    names, reports = await asyncio.gather(
        source.exported_names(), asyncio.gather(*(e.draft_report() for e in engines))
    )
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


async def _verify_fleet(fleet: _Fleet, *, sent: Mapping[str, str], selector: Selector) -> None:
    """Every engine's checksums for the selected roles equal the trainer's; raises SessionError naming the
    engine and tensor of every mismatch."""
    request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=selector)
    results = await fleet.step("verify-checksum", lambda e: e.weights_checker(request, timeout_s=fleet.timeout_s))
    failures = []
    for engine, result in zip(fleet.engines, results):
        problems, num_verified = checksum_problems(sent=sent, ranks=result.ranks, selector=selector)
        fleet.state[engine.url].num_verified = num_verified
        if problems:
            fleet.fail(engine.url, "verify", _shown(problems))
            failures.append(f"{engine.url}: {_shown(problems)}")
        else:
            fleet.state[engine.url].done.add("verify")
    if failures:
        raise SessionError("verification failed (trainer vs engine checksums): " + " | ".join(failures))


def checksum_problems(
    *, sent: Mapping[str, str], ranks: Sequence[RankChecksums], selector: Selector
) -> tuple[list[str], int]:
    """Compare the trainer's checksums of what it sent with one engine's report. Pure.

    Per engine rank, restricted to the roles `selector` covers (draft names carry the "draft." prefix): every tensor
    a selected runner holds must have been sent with the same checksum ("differs" / "extra": held but not sent),
    and every sent tensor must be held by some selected runner. Returns (problem lines, number of tensors that
    matched).
    """
    roles = selector_roles(selector)
    problems: list[str] = [] if ranks else ["the engine reported no checksums"]
    num_verified = 0
    for index, rank in enumerate(ranks):
        where = f"rank {index}: " if len(ranks) > 1 else ""
        held = {name: c for name, c in rank.checksums.items() if _role_of(name) in roles}
        expected: dict[str, str] = {}
        for name, checksum in sent.items():
            keys = [key for key in (name, DRAFT_PREFIX + name) if key in held]
            if not keys:
                problems.append(f"{where}sent {name}: no runner covered by selector {selector.value!r} holds it")
            expected.update((key, checksum) for key in keys)
        problems.extend(where + line for line in compare_checksums(expected, held))
        num_verified += sum(1 for key, checksum in expected.items() if held.get(key) == checksum)
    return problems, num_verified


def _role_of(reported_name: str) -> Role:
    return Role.DRAFT if reported_name.startswith(DRAFT_PREFIX) else Role.TARGET


async def _abandon(
    fleet: _Fleet, *, source: WeightSource, selector: Selector | None, committed: Mapping[str, str] | None
) -> None:
    """After a failure: tear down the source's transport first (an engine blocked in a receive then fails fast and
    releases its weight lock), close every session left open so that the next begin succeeds, then quarantine the
    engines that may hold partial weights.

    An engine whose checksums for the session's roles still equal the committed version's received nothing that
    changed its weights (e.g. a gloo broadcast that failed before its first byte arrived): it keeps serving that
    version. Any other engine that the send may have reached is quarantined: end_weight_update alone would let it
    serve its mix of old and new tensors under the old version. `weights_checker` reset_tensors, for the session's
    selector only (a frozen draft is left alone), makes it refuse generation until a later session completes.
    """
    with contextlib.suppress(Exception):
        await asyncio.wait_for(source.close(), timeout=fleet.timeout_s)
    if "begin" in fleet.attempted and "end" not in fleet.attempted:
        # The engine closes its session even when end reports a failure (e.g. a runner that loaded nothing).
        with contextlib.suppress(SessionError):
            await fleet.step("end-after-failure", lambda e: e.end_weight_update(timeout_s=fleet.timeout_s))
    partial = [e for e in fleet.engines if fleet.may_hold_partial_weights(e.url)]
    if not partial or selector is None:
        return
    if committed:
        partial = await _still_partial(fleet, partial, committed=committed, selector=selector)
    if partial:
        request = WeightsCheckerRequest(action=WeightsCheckerAction.RESET_TENSORS, selector=selector)
        with contextlib.suppress(SessionError):
            await fleet.step(
                "quarantine", lambda e: e.weights_checker(request, timeout_s=fleet.timeout_s), only=partial
            )


async def _still_partial(
    fleet: _Fleet, engines: Sequence[EngineClient], *, committed: Mapping[str, str], selector: Selector
) -> list[EngineClient]:
    """The engines among `engines` whose checksums for `selector`'s roles differ from `committed` or could not be
    read; the others are marked intact (they serve the committed version unchanged)."""
    request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=selector)

    async def intact(engine: EngineClient) -> bool:
        try:
            result = await engine.weights_checker(request, timeout_s=fleet.timeout_s)
        except Exception:  # unreachable or refusing: its state is unknown, so it is treated as partial
            return False
        problems, _ = checksum_problems(sent=committed, ranks=result.ranks, selector=selector)
        return not problems

    verdicts = await asyncio.gather(*(intact(e) for e in engines))
    for engine, is_intact in zip(engines, verdicts):
        fleet.state[engine.url].is_intact = is_intact
    return [e for e, is_intact in zip(engines, verdicts) if not is_intact]


@dataclass(kw_only=True)
class _EngineState:
    done: set[str] = field(default_factory=set)  # steps that succeeded on this engine
    message: str = ""  # the first failure, if any
    num_verified: int = 0
    is_intact: bool = False  # checked after a failed send: still holds the committed version's weights


class _Fleet:
    """Runs one step on every engine concurrently and records, per engine, what succeeded and the first failure."""

    def __init__(self, engines: Sequence[EngineClient], *, timeout_s: float, last_step: str) -> None:
        self.engines = tuple(engines)
        self.timeout_s = timeout_s
        self.last_step = last_step  # an engine succeeded when it got through this step
        self.state = {e.url: _EngineState() for e in self.engines}
        self.attempted: set[str] = set()

    async def step(
        self,
        name: str,
        call: Callable[[EngineClient], Awaitable[object]],
        *,
        only: Sequence[EngineClient] | None = None,
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
        """continue_generation on every engine a pause was sent to, whatever happened since; failures are recorded
        per engine and never raised (this runs in `finally`)."""
        if "pause" in self.attempted:
            with contextlib.suppress(SessionError):
                await self.step("resume", lambda e: e.continue_generation(timeout_s=self.timeout_s))

    def may_hold_partial_weights(self, url: str) -> bool:
        # Bytes may have reached this engine, it did not get through the sync's last step, and no check after the
        # failure found it unchanged.
        state = self.state[url]
        return "send" in self.attempted and self.last_step not in state.done and not state.is_intact


@dataclass(kw_only=True)
class _Run:
    selector: Selector | None = None
    sent: SendResult | None = None
    error: str | None = None
    is_complete: bool = False


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
    fleet: _Fleet, run: _Run, clock: _PhaseClock, *, version: str, previous_version: str, transport_name: str,
    total_s: float,
) -> SyncReport:  # fmt: skip
    sent, s = run.sent, clock.seconds
    engines = tuple(
        EngineResult(
            url=url,
            success=fleet.last_step in state.done,
            is_stale=fleet.may_hold_partial_weights(url),
            num_verified_tensors=state.num_verified,
            weight_version=version if "version" in state.done else None,
            message=state.message,
        )
        for url, state in fleet.state.items()
    )
    return SyncReport(
        version=version,
        previous_version=previous_version,
        committed=run.is_complete,
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
    )


def _shown(problems: Collection[str]) -> str:
    items = list(problems)
    more = len(items) - _NUM_PROBLEMS_SHOWN
    return "; ".join(items[:_NUM_PROBLEMS_SHOWN]) + (f"; and {more} more" if more > 0 else "")
