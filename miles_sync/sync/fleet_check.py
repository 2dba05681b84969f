"""Whether the engines already hold the trainer's current weights, checked without a sync.

Servers reused from an earlier run, or started from another checkpoint, may serve anything. Before the first
rollouts a caller (the main job, `SyncController.check_engines`) asks: the source hashes its current weights as a
send would (`WeightSource.predict`: exported, packed and hashed, nothing sent), every engine's checker answers for
the selector a sync would use (no pause: the checker reads what the engine serves), and each engine gets the
strongest check its answer allows (`verify.sent_verdicts`): exact, engine-exact with the engine's own hash
(SHA-256 on CPU, SGLang's Triton hash on GPU), replica agreement, or none. Only an exact or engine-exact pass shows
that an engine holds the trainer's bytes; every other engine is one to sync before it serves (`FleetCheck.to_sync`).
Nothing here writes to an engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from miles_sync.sync.engine_digests import plan_engine_digests
from miles_sync.sync.session import SelectorInputs, choose_selector, hf_named_urls
from miles_sync.sync.verify import is_against_trainer, sent_verdicts
from miles_sync.sync.weight_source import WeightSource
from miles_sync.wire.api import EngineAPI
from miles_sync.wire.protocol import Selector, WeightsCheckerAction, WeightsCheckerRequest

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sync


@dataclass(frozen=True, kw_only=True)
class EngineHolding:
    """One engine's answer: `method` the check that ran, `holds_trainer_weights` whether it passed a check against
    the trainer's own bytes, `message` what differs or why it could not be compared with them."""

    url: str
    method: str
    holds_trainer_weights: bool
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class FleetCheck:
    """The whole fleet's answers, for the selector a sync would use; `check_s` the time the check took."""

    selector: Selector
    engines: tuple[EngineHolding, ...]
    check_s: float

    @property
    def to_sync(self) -> tuple[str, ...]:
        """The engines not shown to hold the trainer's weights, in fleet order."""
        return tuple(e.url for e in self.engines if not e.holds_trainer_weights)

    def summary(self) -> str:
        if not self.to_sync:
            methods = "+".join(dict.fromkeys(e.method for e in self.engines))
            return f"every engine holds the trainer's weights ({methods}, {self.check_s:.2f} s)"
        shown = "; ".join(f"{e.url} ({e.method}): {e.message or 'not compared with the trainer'}" for e in self.engines)
        return f"{len(self.to_sync)} of {len(self.engines)} engine(s) not shown to hold the trainer's weights: {shown}"


async def check_fleet(
    engines: Sequence[EngineAPI], *, source: WeightSource, inputs: SelectorInputs, timeout_s: float
) -> FleetCheck:
    """The check of the module docstring over connected engines. Raises what the selector cross-check or the
    source raises; an engine whose checker fails is reported as not holding the weights, with its error."""
    start = time.perf_counter()
    exported = await source.exported_names()
    selector = await choose_selector(engines, exported_names=exported, inputs=inputs)
    layouts = await plan_engine_digests(engines, selector=selector, timeout_s=timeout_s)
    predicted = await source.predict(selector=selector, engine_digests=layouts.plan)
    request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=selector)
    results = await asyncio.gather(
        *(e.weights_checker(request, timeout_s=timeout_s) for e in engines), return_exceptions=True
    )
    failed = {e.url: r for e, r in zip(engines, results) if isinstance(r, BaseException)}
    answers = {e.url: r.ranks for e, r in zip(engines, results) if e.url not in failed}
    verdicts = sent_verdicts(
        answers=answers,
        selector=selector,
        checksums=predicted.checksums,
        engine_checksums=predicted.engine_checksums,
        layouts=layouts,
        hf_named=hf_named_urls(engines) & answers.keys(),
    )
    holdings = []
    for engine in engines:
        if engine.url in failed:
            error = failed[engine.url]
            message = f"its checker failed: {str(error) or type(error).__name__}"
            holdings.append(EngineHolding(url=engine.url, method="none", holds_trainer_weights=False, message=message))
            continue
        verdict = verdicts[engine.url]
        holds = verdict.passed and is_against_trainer(verdict)
        holdings.append(
            EngineHolding(url=engine.url, method=verdict.method, holds_trainer_weights=holds, message=verdict.message)
        )
    return FleetCheck(selector=selector, engines=tuple(holdings), check_s=time.perf_counter() - start)
