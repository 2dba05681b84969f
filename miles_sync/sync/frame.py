"""The frame every sync session runs in, whatever it loads (full weights: miles_sync.sync.session; a LoRA adapter:
miles_sync.sync.lora): the fleet's steps and their record per engine, the phase clock, the bracket (the flow under
the session's deadline, what runs after a failure, the resume in `finally`), the stale rule and the report.

The stale rule, one for every kind. An engine stays PAUSED (it gets no continue_generation, so it serves nothing,
and nothing is written to its weights to quarantine it) when
- bytes may have reached it (the flow attempted its `partial_from` step), it did not get through the session's
  `last_step`, and no check after the failure found it intact (`EngineState.is_intact`);
- the mechanism check's reset was sent to it and the session did not complete (it may hold random weights);
- the flow marked it stale, naming why (a LoRA sync that changed its base weights);
- it was held since an earlier failure and this session did not complete on it.

Completing: an engine completes when it gets through `last_step`. In an all-or-nothing session (a LoRA sync, whose
new adapter is unloaded everywhere unless every engine took it) an engine completes only with the whole fleet.
Every engine call is bounded: by the engine client's own timeout, and behind it by the frame's backstop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from miles_sync.sync.report import EngineResult, PhaseTimes, SyncReport
from miles_sync.sync.weight_source import SendResult
from miles_sync.wire.api import EngineAPI
from miles_sync.wire.protocol import PauseMode, Selector

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sync

R = TypeVar("R")

RESET_STEP = "mechanism-reset"  # once attempted, an incomplete session leaves every engine paused
# EngineResult.prefix_cache, where the session emptied it: before the send, with the updates, after the resume.
FLUSHED = "flushed"
FLUSHED_WITH_UPDATES = "flushed with the updates"
FLUSHED_AFTER_RESUME = "flushed after the resume"
# The engine client bounds every call by the session's control timeout; the frame's own deadline sits behind it, so
# a call that hangs past the client (an engine API without a client timeout) still ends, and the client's error,
# which names the endpoint, is the one reported.
_BACKSTOP_S = 5.0
_HELD_MESSAGE = "held paused since an earlier failed sync: may hold partial weights"
_RESET_MESSAGE = "held paused: the mechanism check reset its weights to random values and the sync did not complete"


class SessionError(RuntimeError):
    """A step of the session failed on at least one engine; the message names the step, engines and causes."""


@dataclass(frozen=True, kw_only=True)
class SessionTimeouts:
    """`control_s` bounds each control call to one engine; `sync_s` the whole session from the selector to the
    verification (the resume that follows gets its own `control_s`); `in_place_flush_s` how long, after an in_place
    resume, the session keeps retrying an engine's refused prefix-cache flush (SGLang refuses while any request
    runs, which under steady load is always, and the sync's result waits for it; 0: one attempt, no retry)."""

    control_s: float
    sync_s: float
    in_place_flush_s: float = 0.0

    def __post_init__(self) -> None:
        bad = [f"{n}={v}" for n, v in (("control_s", self.control_s), ("sync_s", self.sync_s)) if not v > 0]
        if not self.in_place_flush_s >= 0:
            bad.append(f"in_place_flush_s={self.in_place_flush_s} (may be 0)")
        if bad:
            raise ValueError(f"session timeouts must be positive: {', '.join(bad)}")


@dataclass(kw_only=True)
class EngineState:
    """What one session did on one engine."""

    done: set[str] = field(default_factory=set)  # steps that succeeded on this engine
    message: str = ""  # the first failure, if any
    checks: list[str] = field(default_factory=list)  # the checks that passed on it, in the order they ran
    num_verified: int = 0  # tensors (or parameters) its checks compared
    digest: str | None = None  # its verified checksum answer, as one digest
    draft: tuple[dict[str, str], ...] | None = None  # its draft digests as the verification read them
    draft_guard: str = ""  # "draft unchanged" when the draft guard ran on it and passed
    is_intact: bool = False  # checked after a failed send: still answers its baseline checksums
    stale_reason: str = ""  # the flow marked it stale: why
    prefix_cache: str = ""  # what the session did to its prefix cache (EngineResult.prefix_cache)
    call_s: dict[str, float] = field(default_factory=dict)  # wall seconds of each step's call to it, by step name

    @property
    def verification(self) -> str:
        return "+".join(self.checks)


class FleetSteps:
    """Runs one step on every engine concurrently and records, per engine, what succeeded and the first failure;
    owns the stale rule (module docstring)."""

    def __init__(
        self,
        engines: Sequence[EngineAPI],
        *,
        timeout_s: float,
        last_step: str,
        held: Collection[str],
        partial_from: str | None = "send",
        all_or_nothing: bool = False,
    ) -> None:
        self.engines = tuple(engines)
        self.timeout_s = timeout_s
        self.last_step = last_step  # an engine completes when it gets through this step
        self.held = frozenset(held)
        self.partial_from = partial_from  # None: no step of the flow can leave partial weights
        self.all_or_nothing = all_or_nothing
        self.state = {e.url: EngineState() for e in self.engines}
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
        bound = self.timeout_s + _BACKSTOP_S
        results = await asyncio.gather(
            *(self._timed(name, e, asyncio.wait_for(call(e), timeout=bound)) for e in engines), return_exceptions=True
        )
        failures = []
        for engine, result in zip(engines, results):
            if isinstance(result, BaseException):
                message = str(result) or f"{type(result).__name__} (no answer within {bound:g} s)"
                self.fail(engine.url, name, message)
                failures.append(f"{engine.url}: {message}")
            else:
                self.state[engine.url].done.add(name)
        if failures:
            raise SessionError(f"{name} failed on {len(failures)} of {len(engines)} engine(s): " + "; ".join(failures))
        return list(results)

    async def _timed(self, name: str, engine: EngineAPI, call: Awaitable[R]) -> R:
        """`call`'s result; its wall time is recorded against `name` on `engine` whether it succeeds or not (a step
        entered twice adds up), so the report names the call a slow phase spent its time in."""
        start = time.perf_counter()
        try:
            return await call
        finally:
            seconds = self.state[engine.url].call_s
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

    def fail(self, url: str, step: str, message: str) -> None:
        state = self.state[url]
        if not state.message:
            state.message = f"{step}: {message}"

    def mark_stale(self, url: str, reason: str) -> None:
        """The flow found this engine unfit to serve (the reason becomes its message)."""
        self.state[url].stale_reason = reason
        self.fail(url, "verify", reason)

    def completed(self, url: str) -> bool:
        return self.last_step in self.state[url].done and (self.is_complete or not self.all_or_nothing)

    def may_hold_partial_weights(self, url: str) -> bool:
        # Bytes may have reached this engine, it did not get through the sync's last step, and no check after the
        # failure found it unchanged.
        state = self.state[url]
        if self.partial_from is None or self.partial_from not in self.attempted:
            return False
        return self.last_step not in state.done and not state.is_intact

    @property
    def may_hold_random_weights(self) -> bool:
        """Fleet-wide: the mechanism check's reset went to every engine (it may have run where the call failed or
        timed out) and the session did not complete, so any of them may hold random weights."""
        return RESET_STEP in self.attempted and not self.is_complete

    def is_stale(self, url: str) -> bool:
        """Must stay paused (module docstring)."""
        return (
            self.may_hold_partial_weights(url)
            or self.may_hold_random_weights
            or bool(self.state[url].stale_reason)
            or (url in self.held and not self.completed(url))
        )

    async def flush_while_paused(self) -> None:
        """/flush_cache on every engine (SessionError if any refused), each recorded as flushed: the pause emptied
        them (abort, retract), so nothing on the new weights will reuse a prefix the old ones computed."""
        await self.step("flush", lambda e: e.flush_cache(timeout_s=self.timeout_s))
        for state in self.state.values():
            state.prefix_cache = FLUSHED

    async def resume(self) -> None:
        """continue_generation on every engine a pause was sent to that may serve, whatever happened since;
        failures are recorded per engine and never raised (this runs in `finally`). A stale engine stays paused."""
        serving = [e for e in self.engines if not self.is_stale(e.url)]
        if "pause" in self.attempted and serving:
            with contextlib.suppress(SessionError):
                await self.step("resume", lambda e: e.continue_generation(timeout_s=self.timeout_s), only=serving)

    async def flush_after_in_place_resume(self, *, window_s: float) -> list[str]:
        """An in_place pause keeps requests running, and SGLang refuses to flush its prefix cache while any runs,
        so the cache is flushed only if they let it: one attempt, retried while the engine answers 400 for at most
        `window_s` (0: none). Under steady load no request-free moment comes, and the sync must not stall on it
        (each retry window is time the training loop waits). Where it was not flushed, cached prefixes computed
        with the old weights may be reused (as in_place's running requests reuse their own KV). Records the
        outcome per engine and returns a warning per engine that could not be flushed; never raises."""
        engines = [e for e in self.engines if "resume" in self.state[e.url].done and "send" in self.attempted]

        async def flush(engine: EngineAPI) -> str | None:
            state = self.state[engine.url]
            try:
                flushed = engine.flush_cache(drain_s=window_s, timeout_s=self.timeout_s)
                await self._timed("flush-after-resume", engine, flushed)
            except Exception as exc:
                why = str(exc) or type(exc).__name__
                state.prefix_cache = f"not flushed: {why}"
                return f"{engine.url}: prefix cache not flushed after the in_place resume: {why}"
            state.prefix_cache = FLUSHED_AFTER_RESUME
            return None

        return [w for w in await asyncio.gather(*(flush(e) for e in engines)) if w is not None]

    def engine_message(self, url: str) -> str:
        message = self.state[url].message
        if self.may_hold_random_weights:  # whatever failed first, the reset is why it stays paused
            return "; ".join(m for m in (message, _RESET_MESSAGE) if m)
        return message or (_HELD_MESSAGE if self.is_stale(url) else "")


class PhaseClock:
    """Wall seconds per phase name; a phase entered twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@dataclass(kw_only=True)
class SessionRun:
    """What a flow learned on its way, for the report."""

    selector: Selector | None = None
    sent: SendResult | None = None
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)


async def run_in_frame(
    fleet: FleetSteps,
    *,
    flow: Callable[[], Awaitable[None]],
    run: SessionRun,
    clock: PhaseClock,
    sync_s: float,
    pause_mode: PauseMode,
    in_place_flush_s: float,
    after_failure: Callable[[], Awaitable[None]] | None = None,
    settle: Callable[[], Awaitable[None]] | None = None,
    before_resume: Callable[[Sequence[str]], Awaitable[list[str]]] | None = None,
) -> None:
    """The bracket: `flow` under the session's deadline (complete when it returns), `after_failure` when it raised
    (its error goes into `run`), `settle` either way, then `before_resume` with the engines that stay paused (its
    warnings into `run`) and the resume of every engine that may serve, always. Never raises for a failed sync."""
    try:
        try:
            await asyncio.wait_for(flow(), timeout=sync_s)
            fleet.is_complete = True
        except Exception as exc:  # every failure of a step ends here and goes into the report
            # wait_for's own timeout carries no message, and neither do some errors from below our steps (a source
            # whose process died answers EOFError): name what failed, never a timeout that did not happen.
            if str(exc):
                run.error = str(exc)
            elif isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
                run.error = f"{type(exc).__name__}: the sync did not finish within {sync_s} s"
            else:
                run.error = f"{type(exc).__name__} (no message) in the sync"
            if after_failure is not None:
                await after_failure()
        if settle is not None:
            await settle()
    finally:
        with clock.phase("resume"):
            paused = [e.url for e in fleet.engines if fleet.is_stale(e.url)]
            if before_resume is not None and paused:
                try:
                    run.warnings.extend(await before_resume(paused))
                except Exception as exc:  # the hook promises not to raise; the resume must run whatever it does
                    run.warnings.append(f"before the resume: {exc}")
            await fleet.resume()
            if pause_mode is PauseMode.IN_PLACE:
                run.warnings.extend(await fleet.flush_after_in_place_resume(window_s=in_place_flush_s))


def session_report(
    fleet: FleetSteps,
    run: SessionRun,
    clock: PhaseClock,
    *,
    version: str,
    previous_version: str,
    transport: str,
    is_checked: bool,
) -> SyncReport:
    """The session's SyncReport from the fleet's record: per engine its outcome, staleness and checks; fleet-wide
    the checks that passed ("off" when the session checks nothing)."""
    sent, s = run.sent, clock.seconds
    engines = tuple(
        EngineResult(
            url=url,
            success=fleet.completed(url),
            is_stale=fleet.is_stale(url),
            num_verified_tensors=state.num_verified,
            weight_version=version if "version" in state.done else None,
            message=fleet.engine_message(url),
            verification=state.verification if fleet.completed(url) or not fleet.all_or_nothing else "",
            weights_digest=state.digest,
            draft_digests=state.draft if "verify" in state.done else None,
            draft_guard=state.draft_guard,
            call_s=dict(state.call_s),
            prefix_cache=state.prefix_cache,
        )
        for url, state in fleet.state.items()
    )
    return SyncReport(
        version=version,
        previous_version=previous_version,
        committed=fleet.is_complete,
        selector=run.selector,
        transport=transport,
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
        total_s=time.perf_counter() - run.start,
        engines=engines,
        error=run.error,
        checksums={} if sent is None else dict(sent.checksums),
        verification=fleet_verification(fleet) if is_checked else "off",
        warnings=tuple(run.warnings),
    )


def fleet_verification(fleet: FleetSteps) -> str:
    """The checks that passed on any engine, "+"-joined: by the position each ran at, then by name (e.g.
    "mechanism+engine-exact+exact")."""
    positions: dict[str, int] = {}
    for state in fleet.state.values():
        for i, check in enumerate(state.checks):
            positions[check] = min(i, positions.get(check, i))
    return "+".join(sorted(positions, key=lambda check: (positions[check], check)))
