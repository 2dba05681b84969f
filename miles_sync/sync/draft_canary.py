"""The acceptance canary: after the resume, one fixed greedy prompt per engine measures its draft's accept length.

Digests prove bytes. A draft whose bytes are right but that the kernels read in the wrong layout (a post-load
shuffle applied twice, a fused projection loaded in another order) passes every digest and still accepts almost
nothing. The canary measures what the draft does: a few fixed greedy prompts (`temperature` 0) per engine after
each committed sync, the mean of their `meta_info.spec_accept_length` (SGLang's tokens per verify step) compared
with the engine's baseline.

Decision: the baseline is the engine's last passing reading (first at connect), not the connect reading forever.
A frozen draft drifts as the policy it no longer matches moves (the default run: 3.16 -> 1.00 over 10 syncs, at
most 24% lower from one sync to the next), which a fixed baseline would flag as corruption; a layout fault drops
it in one sync (3.04 -> 1.00, 67% lower). A flagged reading does not become the baseline, so a collapse keeps
being flagged until the draft recovers. An engine that answers no accept length (no draft) is not measured.

`warn` puts the finding in the sync report's warnings; `hold` also pauses the engine again and keeps it out of
serving, with its weights untouched, until a later sync verifies on it and its canary passes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from miles_sync.wire.api import EngineAPI
from miles_sync.wire.codec import WireEnum
from miles_sync.wire.protocol import GenerateRequest, PauseMode, SamplingParams
from miles_sync.wire.text import raise_if

__all__ = ["CanaryMode", "CanarySettings"]


class CanaryMode(WireEnum):
    """none: never measured; warn: a drop is a report warning; hold: a drop also holds the engine paused."""

    NONE = "none"
    WARN = "warn"
    HOLD = "hold"


@dataclass(frozen=True, kw_only=True)
class CanarySettings:
    """`prompts`: the canary prompts as token ids (the engine's vocabulary must hold them; prompts from the task the
    draft was trained on give a baseline worth comparing with). The reading is the mean accept length over them:
    one greedy trajectory can leave what the draft predicts at a single token, several average that out.
    `min_ratio`: the lowest passing reading as a fraction of the baseline. `max_new_tokens`: each greedy
    completion's length (more tokens, steadier reading)."""

    mode: CanaryMode = CanaryMode.NONE
    min_ratio: float = 0.5
    prompts: tuple[tuple[int, ...], ...] = ()
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.min_ratio <= 1:
            problems.append(f"min_ratio={self.min_ratio} is not in (0, 1]")
        if self.mode is not CanaryMode.NONE and not (self.prompts and all(self.prompts)):
            problems.append(f"mode={self.mode.value} needs prompts, each with at least one token id")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} must be positive")
        raise_if(problems, what="invalid canary settings")

    @property
    def is_enabled(self) -> bool:
        return self.mode is not CanaryMode.NONE


@dataclass(frozen=True, kw_only=True)
class CanaryReading:
    """One engine's canary after one sync. `accept_length` None: the engine answered none (no draft), or the
    request failed (`message` says why). `flagged`: below `min_ratio` x `baseline`."""

    url: str
    accept_length: float | None
    baseline: float | None
    flagged: bool = False
    message: str = ""


def canary_requests(settings: CanarySettings) -> list[GenerateRequest]:
    """The canary's requests: each prompt, greedy, `max_new_tokens` long."""
    params = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=0.0)
    return [GenerateRequest(input_ids=prompt, sampling_params=params) for prompt in settings.prompts]


def mean_reading(accept_lengths: Sequence[float | None]) -> float | None:
    """The engine's reading: the mean over its canary answers, None when any answered none (no draft)."""
    if not accept_lengths or any(a is None for a in accept_lengths):
        return None
    return sum(accept_lengths) / len(accept_lengths)


def judge_reading(url: str, *, accept_length: float | None, baseline: float | None, min_ratio: float) -> CanaryReading:
    """The verdict on one reading: flagged when both numbers exist and the reading is below `min_ratio` of the
    baseline; the message names engine, both numbers and the ratio."""
    if accept_length is None or baseline is None:
        return CanaryReading(url=url, accept_length=accept_length, baseline=baseline)
    if accept_length >= min_ratio * baseline:
        return CanaryReading(url=url, accept_length=accept_length, baseline=baseline)
    message = (
        f"{url}: draft canary accept length {accept_length:.3f} is below {min_ratio:g} x its baseline "
        f"{baseline:.3f} ({accept_length / baseline:.2f}): the draft's bytes may be right while its kernels read "
        f"them in the wrong layout"
    )
    return CanaryReading(url=url, accept_length=accept_length, baseline=baseline, flagged=True, message=message)


def next_baselines(baselines: dict[str, float], readings: Sequence[CanaryReading]) -> dict[str, float]:
    """The baselines after `readings`: every passing reading replaces its engine's (module docstring)."""
    updated = dict(baselines)
    for reading in readings:
        if reading.accept_length is not None and not reading.flagged:
            updated[reading.url] = reading.accept_length
    return updated


async def measure_canary(
    engines: Mapping[str, EngineAPI], settings: CanarySettings, *, baselines: Mapping[str, float], timeout_s: float
) -> list[CanaryReading]:
    """The canary's requests on every engine (URL -> engine), each engine's mean judged against `baselines`; an
    engine whose requests failed gets a reading without an accept length whose message says why. Never raises."""
    requests = canary_requests(settings)

    async def measure(url: str, engine: EngineAPI) -> CanaryReading:
        try:
            answers = await asyncio.gather(*(engine.generate(r, timeout_s=timeout_s) for r in requests))
        except Exception as exc:
            why = f"{url}: draft canary request failed: {str(exc) or type(exc).__name__}"
            return CanaryReading(url=url, accept_length=None, baseline=baselines.get(url), message=why)
        return judge_reading(
            url,
            accept_length=mean_reading([a.meta_info.spec_accept_length for a in answers]),
            baseline=baselines.get(url),
            min_ratio=settings.min_ratio,
        )

    return list(await asyncio.gather(*(measure(u, e) for u, e in engines.items())))


@dataclass(frozen=True, kw_only=True)
class CanaryOutcome:
    """The canary after one committed sync: its readings, every engine's baseline after them, the engines it holds
    (hold mode: paused again, URL -> why) and its report warnings."""

    readings: tuple[CanaryReading, ...]
    baselines: dict[str, float]
    held: dict[str, str]
    warnings: tuple[str, ...]


async def run_canary(
    engines: Mapping[str, EngineAPI],
    settings: CanarySettings,
    *,
    baselines: Mapping[str, float],
    version: str,
    pause_mode: PauseMode,
    timeout_s: float,
) -> CanaryOutcome:
    """The canary on the engines a committed sync verified (module docstring). In hold mode a flagged engine is
    paused again here, its weights untouched, and named in `held` (also when that pause failed: it is then still
    unrouted, and stale until a later sync's canary passes). Never raises."""
    readings = await measure_canary(engines, settings, baselines=baselines, timeout_s=timeout_s)
    warnings = [r.message for r in readings if r.message]
    held = {}
    if settings.mode is CanaryMode.HOLD:
        for reading in (r for r in readings if r.flagged):
            try:
                await engines[reading.url].pause_generation(pause_mode, timeout_s=timeout_s)
            except Exception as exc:
                warnings.append(f"{reading.url}: pausing it for the draft canary failed: {exc}")
            held[reading.url] = f"sync v{version}: {reading.message}"
    return CanaryOutcome(
        readings=tuple(readings),
        baselines=next_baselines(dict(baselines), readings),
        held=held,
        warnings=tuple(warnings),
    )
