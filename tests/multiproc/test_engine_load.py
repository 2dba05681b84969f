"""Generation load across weight syncs: 200 concurrent /generate requests spread over two reference engines while
three real sync sessions (a sender process, gloo broadcast, verified checksums) change the weights under them.

Request i's prompt starts at token i, and the checkpoints' language is a single cycle (x -> 5x + 17 mod 256) that
the target decodes exactly, so an answer's tokens name the request they belong to: the expected output is known
per id, a token lost or repeated across a retract shows, and the outputs of all requests form a permutation.
Each answer is timed against the sync windows (the wall time of each `SyncController.sync` call) to check which
weight version(s) it may carry.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from reference_server import reference_server
from sender_host import ProcessSource, SenderSettings

from miles_sync.engine.client import EngineClient
from miles_sync.engine.reference.checkpoints import LanguageRecipe, next_token
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.report import SyncReport
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.wire.protocol import FinishReasonKind, GenerateRequest, GenerateResponse, PauseMode, SamplingParams

pytestmark = pytest.mark.slow
# The session's version step (session.py `_sync`, step "version") calls EngineClient.update_weight_version, which
# sends abort_all_requests=False, not the endpoint's wire default of true (client.py, protocol.py): the version
# step aborts nothing, so every request a retract just put back and every request that arrived during an
# abort-mode pause stays queued and completes under the new weights. Only the abort-mode pause itself aborts.
NUM_REQUESTS = 200
NUM_SYNCS = 3
_SEGMENT = NUM_REQUESTS // (NUM_SYNCS + 1)  # requests per load segment (_LoadProgress)
MAX_NEW_TOKENS = 32
# Requests start one every 15 ms, so the load lasts ~3 s and every sync lands while some requests run, others wait
# and new ones arrive (see _LoadProgress for when each sync starts).
ARRIVAL_GAP_S = 0.015
REQUEST_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 120.0
TIMEOUTS = SessionTimeouts(control_s=20.0, sync_s=60.0)
LANGUAGE = LanguageRecipe()
FROZEN_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)


@dataclass(frozen=True, kw_only=True)
class Answer:
    """What one request got back; `error` is set (and `response` None) when no 200 answer came."""

    request_id: int
    sent_at: float
    answered_at: float
    response: GenerateResponse | None
    error: str | None


@dataclass(frozen=True, kw_only=True)
class SyncWindow:
    """Wall time of one sync call: its pause and resume both happen in [start, end]."""

    start: float
    end: float
    report: SyncReport


@pytest.fixture(scope="module")
def engines(reference_checkpoints, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("load")
    with start_engine(reference_checkpoints, log_dir) as a, start_engine(reference_checkpoints, log_dir) as b:
        yield [a, b]


def start_engine(checkpoints: Path, log_dir: Path):
    return reference_server(
        model=checkpoints / "target",
        log_dir=log_dir,
        draft_kind="mtp",
        weight_layout="aiter",
        finalize_policy="strict",
    )


def prompt(request_id: int) -> tuple[int, ...]:
    return (request_id, next_token(request_id, LANGUAGE))


def expected_output(request_id: int) -> tuple[int, ...]:
    """The greedy continuation of request `request_id`'s prompt: the language's next MAX_NEW_TOKENS tokens."""
    tokens, token = [], prompt(request_id)[-1]
    for _ in range(MAX_NEW_TOKENS):
        token = next_token(token, LANGUAGE)
        tokens.append(token)
    return tuple(tokens)


class _LoadProgress:
    """Requests sent, answers received and syncs started so far; both sides wait on it. The requests come in
    NUM_SYNCS + 1 segments: segment k (k > 0) starts arriving once sync k - 1 started (so some arrive during its
    pause), and sync k starts once segment k is sent and one of its requests completed after sync k - 1 ended, or
    once all of segment k is answered. So each sync lands inside the load (segment k's latest requests are in
    flight when it pauses), every version serves whole requests, and the last segment completes under the last
    version, on a fast machine or a loaded one: nothing depends on how long a request or a sync takes."""

    def __init__(self) -> None:
        self.num_sent = 0
        self.num_syncs_started = 0
        self.answers: list[Answer] = []
        self._changed = asyncio.Condition()

    async def wait_for_segment(self, request_id: int) -> None:
        segment = min(request_id // _SEGMENT, NUM_SYNCS)
        async with self._changed:
            await self._changed.wait_for(lambda: self.num_syncs_started >= segment)

    async def record_sync_started(self) -> None:
        async with self._changed:
            self.num_syncs_started += 1
            self._changed.notify_all()

    async def record_sent(self) -> None:
        async with self._changed:
            self.num_sent += 1
            self._changed.notify_all()

    async def record_answer(self, answer: Answer) -> None:
        async with self._changed:
            self.answers.append(answer)
            self._changed.notify_all()

    async def wait_for_sync(self, k: int, *, previous_end: float) -> None:
        def is_due() -> bool:
            segment = [a for a in self.answers if k * _SEGMENT <= a.request_id < (k + 1) * _SEGMENT]
            served = any(a.answered_at >= previous_end and is_complete(a) for a in segment)
            # An in_place sync ends up to in_place_flush_s after its resume (the post-resume cache flush is retried
            # while requests run): time enough to serve all of a segment that queued during its pause, after which
            # no answer is left to come after the sync's end.
            return self.num_sent >= (k + 1) * _SEGMENT and (served or len(segment) == _SEGMENT)

        async with self._changed:
            await self._changed.wait_for(is_due)


def is_complete(answer: Answer) -> bool:
    return answer.response is not None and answer.response.meta_info.finish_reason.type is FinishReasonKind.LENGTH


async def run_load(
    urls: Sequence[str], source: ProcessSource, *, pause_mode: PauseMode, first_step: int
) -> tuple[dict[int, list[Answer]], list[SyncWindow], str, list[str]]:
    """Send NUM_REQUESTS requests (round robin over `urls`) while NUM_SYNCS syncs run one after another.

    Returns every answer per request id, the sync windows, the version served before the first sync, and the
    version each engine serves after the load.
    """
    await source.call("configure", SenderSettings(transport="distributed", bucket_bytes=256 * 1024, include_mtp=False))
    ctl = SyncController(
        engine_urls=urls,
        source=source,
        transport="distributed",
        selector_inputs=FROZEN_DRAFT,
        pause_mode=pause_mode,
        verify=True,
        timeouts=TIMEOUTS,
        show_progress=False,
    )
    await ctl.connect()
    clients = [EngineClient(url, timeout_s=REQUEST_TIMEOUT_S) for url in urls]
    answers: dict[int, list[Answer]] = {i: [] for i in range(NUM_REQUESTS)}
    progress = _LoadProgress()
    initial_version = ctl.weight_version

    async def request(request_id: int) -> None:
        await asyncio.sleep(request_id * ARRIVAL_GAP_S)
        await progress.wait_for_segment(request_id)
        params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
        sent_at = time.monotonic()
        await progress.record_sent()
        response, error = None, None
        try:
            response = await clients[request_id % len(clients)].generate(
                GenerateRequest(input_ids=prompt(request_id), sampling_params=params)
            )
        except Exception as exc:  # recorded, asserted on by the test: a failed request is a finding, not a crash
            error = f"{type(exc).__name__}: {exc}"
        answer = Answer(
            request_id=request_id, sent_at=sent_at, answered_at=time.monotonic(), response=response, error=error
        )
        answers[request_id].append(answer)
        await progress.record_answer(answer)

    async def syncs() -> list[SyncWindow]:
        windows = []
        for k in range(NUM_SYNCS):
            await progress.wait_for_sync(k, previous_end=windows[-1].end if windows else float("-inf"))
            await source.call("step", first_step + k)  # new weights for every sync
            start = time.monotonic()
            await progress.record_sync_started()
            report = await ctl.sync()
            windows.append(SyncWindow(start=start, end=time.monotonic(), report=report))
        return windows

    try:
        _, windows = await asyncio.wait_for(
            asyncio.gather(asyncio.gather(*(request(i) for i in range(NUM_REQUESTS))), syncs()),
            timeout=LOAD_TIMEOUT_S,
        )
        served = [(await c.model_info()).weight_version for c in clients]
        assert ctl.stale_engines == ()
    finally:
        for client in clients:
            await client.close()
        await ctl.close()
    return answers, windows, initial_version, served


def check_one_answer_each(answers: dict[int, list[Answer]]) -> list[Answer]:
    """Every request got exactly one answer, a 200 whose tokens continue that request's own prompt."""
    assert sorted(answers) == list(range(NUM_REQUESTS))
    counts = {i: len(a) for i, a in answers.items() if len(a) != 1}
    assert not counts, f"requests answered other than once: {counts}"
    flat = [a for (a,) in answers.values()]
    errors = [(a.request_id, a.error) for a in flat if a.error is not None]
    assert not errors, f"{len(errors)} requests failed, e.g. {errors[:3]}"
    for a in flat:
        # The language is a bijection, so tokens continuing request i's prompt could belong to no other request.
        output = a.response.output_ids
        assert output == expected_output(a.request_id)[: len(output)], f"request {a.request_id}: {output}"
        assert a.response.meta_info.completion_tokens == len(output)
    return flat


def check_syncs(windows: Sequence[SyncWindow], *, served: Sequence[str]) -> list[str]:
    """Every sync committed, verified every tensor on every engine and sent new weights; returns the versions."""
    assert len(windows) == NUM_SYNCS
    reports = [w.report for w in windows]
    for report in reports:
        assert report.committed and report.error is None, report.error
        assert all(e.success and not e.is_stale and e.weight_version == report.version for e in report.engines)
        assert [e.num_verified_tensors for e in report.engines] == [report.num_tensors] * 2 and report.num_tensors
    versions = [r.version for r in reports]
    assert [int(v) for v in versions] == list(range(int(versions[0]), int(versions[0]) + NUM_SYNCS))
    assert all(a.checksums != b.checksums for a, b in zip(reports, reports[1:]))
    assert list(served) == [versions[-1]] * 2
    return versions


def check_versions(answer: Answer, *, order: Sequence[str], windows: Sequence[SyncWindow]) -> None:
    """The versions a response carries are consecutive versions in commit order, the last being its
    `weight_version`, and exactly the one in force when the request lived wholly between two syncs."""
    meta = answer.response.meta_info
    tagged = list(meta.token_versions)
    if not tagged:
        assert not answer.response.output_ids, f"request {answer.request_id} has tokens but no version"
        return
    first = order.index(tagged[0])
    assert tagged == list(order[first : first + len(tagged)]), (answer.request_id, tagged)
    assert meta.weight_version == tagged[-1]
    # The version in force between sync k-1's end and sync k's start is order[k].
    bounds = [float("-inf"), *(w.end for w in windows)]
    ends = [*(w.start for w in windows), float("inf")]
    for k, (after, before) in enumerate(zip(bounds, ends)):
        if after <= answer.sent_at and answer.answered_at <= before:
            assert tagged == [order[k]], (answer.request_id, tagged, order[k])


def test_200_requests_across_3_retract_syncs_lose_nothing(engines, source):
    answers, windows, initial, served = asyncio.run(
        run_load([e.url for e in engines], source, pause_mode=PauseMode.RETRACT, first_step=1)
    )
    flat = check_one_answer_each(answers)
    order = [initial, *check_syncs(windows, served=served)]
    aborted = [a.request_id for a in flat if a.response.meta_info.finish_reason.type is FinishReasonKind.ABORT]
    assert not aborted, (
        f"{len(aborted)} requests aborted under retract, e.g. {aborted[:5]}: "
        f"{answers[aborted[0]][0].response.meta_info.finish_reason.message}"
    )
    for a in flat:
        assert a.response.meta_info.finish_reason.type is FinishReasonKind.LENGTH
        assert a.response.output_ids == expected_output(a.request_id)  # no token lost or repeated by a retract
        check_versions(a, order=order, windows=windows)
    seen = {v for a in flat for v in a.response.meta_info.token_versions}
    assert len(seen) > 1, f"every answer came from version(s) {seen}: the syncs missed the load"
    spanning = [a for a in flat if len(a.response.meta_info.token_versions) > 1]
    assert spanning, "no request was retracted mid-generation and resumed under a newer version"


def test_200_requests_across_3_abort_syncs_report_aborts_and_lose_nothing_else(engines, source):
    answers, windows, initial, served = asyncio.run(
        run_load([e.url for e in engines], source, pause_mode=PauseMode.ABORT, first_step=4)
    )
    flat = check_one_answer_each(answers)
    order = [initial, *check_syncs(windows, served=served)]
    aborted = [a for a in flat if a.response.meta_info.finish_reason.type is FinishReasonKind.ABORT]
    completed = [a for a in flat if a.response.meta_info.finish_reason.type is FinishReasonKind.LENGTH]
    assert len(aborted) + len(completed) == NUM_REQUESTS
    assert aborted and completed, (len(aborted), len(completed))
    for a in aborted:
        # Only a sync aborts, so an aborted request lived through part of one, and got fewer tokens than asked for.
        assert any(a.sent_at < w.end and w.start < a.answered_at for w in windows), f"{a.request_id} aborted off-sync"
        assert len(a.response.output_ids) < MAX_NEW_TOKENS
        check_versions(a, order=order, windows=windows)
    # Only the pause may abort: a request that reached the engine after it waits and completes under the new weights.
    reasons = collections.Counter(a.response.meta_info.finish_reason.message for a in aborted)
    assert set(reasons) == {"aborted by pause_generation(mode='abort')"}, reasons
    for a in completed:
        assert a.response.output_ids == expected_output(a.request_id)
        # Abort never resumes a request across a sync: all of a completed request's tokens come from one version.
        assert len(a.response.meta_info.token_versions) == 1, (a.request_id, a.response.meta_info.weight_versions)
        check_versions(a, order=order, windows=windows)
    seen = {a.response.meta_info.weight_version for a in completed}
    assert len(seen) > 1, f"every completed answer came from version(s) {seen}: the syncs missed the load"


def test_200_requests_across_3_in_place_syncs_continue_every_request(engines, source):
    answers, windows, initial, served = asyncio.run(
        run_load([e.url for e in engines], source, pause_mode=PauseMode.IN_PLACE, first_step=7)
    )
    flat = check_one_answer_each(answers)
    order = [initial, *check_syncs(windows, served=served)]
    # in_place aborts nothing: a request running at the pause stays in the batch with its tokens and continues
    # under the new weights after the resume (the spanning ones below).
    for a in flat:
        assert a.response.meta_info.finish_reason.type is FinishReasonKind.LENGTH, (a.request_id, a.response)
        assert a.response.output_ids == expected_output(a.request_id)
        check_versions(a, order=order, windows=windows)
    spanning = [a for a in flat if len(a.response.meta_info.token_versions) > 1]
    assert spanning, "no request was paused mid-generation and continued under a newer version"
    # Each engine's prefix cache was flushed after the resume, or the report says why not (requests still running).
    for report in (w.report for w in windows):
        for e in report.engines:
            assert e.prefix_cache == "flushed after the resume" or e.prefix_cache.startswith("not flushed:"), e
