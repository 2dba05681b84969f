"""The opt-in mechanism check on a controller's first sync: snapshot, reset to random, sync, compare.

Real reference engines (the pre-trained target with its frozen MTP draft in the AITER layout, strict finalize; TP=1
and one TP=2), each behind a recording proxy, and a real sender process over gloo. The trainer sends the
checkpoint's own weights (step 0), which the engines loaded at start, so after the sync every selected weight
must equal the snapshot again:
- opted in, a complete export passes the compare, is verified by checksums too, commits and resumes; the second
  sync of the controller never runs the check;
- opted in, an export that drops one tensor fails the compare, which names it; every engine stays paused (it holds
  random weights and is never resumed) until a later full sync verifies on it; so does every engine when the
  session fails after the reset and before anything was sent;
- by default nothing asks an engine's weights checker to snapshot, reset or compare.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import pytest
from recording_proxy import recording_proxy
from reference_server import reference_server
from sender_host import SenderSettings, load_checkpoint

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.report import SyncError
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.weights.checksum import tensor_checksum
from miles_sync.wire.protocol import (
    GenerateRequest,
    PauseMode,
    SamplingParams,
    Selector,
    WeightsCheckerAction,
    WeightsCheckerRequest,
)

# Slow: four fleets of real engines (about 70 s here); the full run keeps them, the quick loop skips them. The
# only module whose requests may ask for reset_tensors (the check's own step; tests/conftest.py fails any other).
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.allows_reset_tensors]

BUCKET_BYTES = 256 * 1024
COLLECTIVE_TIMEOUT_S = 15.0
TIMEOUTS = SessionTimeouts(control_s=20.0, sync_s=60.0)
ENGINE_ARGS = dict(draft_kind="mtp", weight_layout="aiter", finalize_policy="strict")
FROZEN_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
PROMPT = GenerateRequest(input_ids=(3, 100, 7), sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0))
CHECKER_ACTIONS = ("snapshot", "reset_tensors", "compare")


def settings(*, skip_names: tuple[str, ...] = ()) -> SenderSettings:
    return SenderSettings(transport="distributed", bucket_bytes=BUCKET_BYTES, include_mtp=False, skip_names=skip_names)


@contextlib.contextmanager
def fresh_engines(checkpoints: Path, log_dir: Path, *, tp_sizes: tuple[int, ...]):
    """Engines that just loaded the checkpoint (version 0), each reached through its recording proxy."""
    with contextlib.ExitStack() as stack:
        proxies = []
        for tp in tp_sizes:
            extra = ("--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S), *(("--tp-size", str(tp)) if tp > 1 else ()))
            server = stack.enter_context(
                reference_server(model=checkpoints / "target", log_dir=log_dir, **ENGINE_ARGS, extra_args=extra)
            )
            proxies.append(stack.enter_context(recording_proxy(server.url)))
        yield proxies


def controller(urls, source, **options) -> SyncController:
    return SyncController(
        engine_urls=urls,
        source=source,
        transport="distributed",
        selector_inputs=FROZEN_DRAFT,
        pause_mode=PauseMode.RETRACT,
        verify=True,
        timeouts=TIMEOUTS,
        show_progress=False,
        **options,
    )


def control_calls(proxy) -> list[str]:
    """The session's calls to one engine, in order: paths, a weights checker call as "checker:<action>"."""
    calls = []
    for r in proxy.requests:
        if r.method != "POST" or r.path == "/update_weights_from_distributed":
            continue
        if r.path == "/weights_checker":  # connect's capability probe posts a body no checker accepts
            calls.append(f"checker:{r.body['action']}" if isinstance(r.body, dict) else "checker:probe")
        else:
            calls.append(r.path)
    return calls


def checker_requests(proxy, actions=CHECKER_ACTIONS) -> list[dict]:
    checker = [r.body for r in proxy.requests if r.path == "/weights_checker" and isinstance(r.body, dict)]
    return [b for b in checker if b.get("action") in actions]


async def is_paused(url: str) -> bool:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/get_server_info", timeout=aiohttp.ClientTimeout(total=20)) as answer:
            return bool((await answer.json())["internal_states"][0]["is_paused"])


async def generate(url: str, *, timeout_s: float = 60.0):
    async with EngineClient(url, timeout_s=timeout_s) as client:
        return await client.generate(PROMPT)


async def target_checksums(url: str) -> dict[str, str]:
    async with EngineClient(url, timeout_s=20.0) as client:
        request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.TARGET)
        return dict((await client.weights_checker(request)).ranks[0].checksums)


def test_first_sync_of_unchanged_weights_proves_the_mechanism_and_commits(reference_checkpoints, source, tmp_path):
    with fresh_engines(reference_checkpoints, tmp_path, tp_sizes=(1, 2)) as proxies:
        urls = [p.url for p in proxies]

        async def main():
            await source.call("configure", settings())
            await source.call("step", 0)  # the checkpoint the engines loaded
            ctl = controller(urls, source, mechanism_check=True)
            await ctl.connect()
            try:
                first = await ctl.sync()
                calls = [control_calls(p) for p in proxies]
                checker = [checker_requests(p) for p in proxies]
                served = [await generate(u) for u in urls]
                for proxy in proxies:
                    proxy.requests.clear()
                await source.call("step", 1)
                second = await ctl.sync()
            finally:
                await ctl.close()
            return first, calls, checker, served, second

        first, calls, checker, served, second = asyncio.run(main())
        again = [checker_requests(p) for p in proxies]

    assert first.committed and first.version == "1" and first.error is None, first.error
    assert first.verification == "mechanism+engine-exact (sha256)+exact"
    assert [e.verification for e in first.engines] == ["mechanism+exact", "mechanism+engine-exact (sha256)"]
    assert all(e.success and not e.is_stale for e in first.engines)
    for sequence in calls:
        # At connect, the draft guard's baseline read; after the flush and before begin: snapshot, reset; after the
        # version: compare, then the checksums.
        expected = [
            "checker:checksum",
            "/pause_generation",
            "/flush_cache",
            "checker:snapshot",
            "checker:reset_tensors",
            "/begin_weight_update",
            "/end_weight_update",
            "/update_weight_version",
            "checker:compare",
            "checker:checksum",
            "/continue_generation",
        ]
        assert [c for c in sequence if c in expected] == expected
    for bodies in checker:  # one each, over the session's selector
        assert [(b["action"], b["selector"]) for b in bodies] == [(a, "target") for a in CHECKER_ACTIONS]
    assert [r.meta_info.weight_version for r in served] == ["1", "1"]
    # Only the first sync: the next one runs the normal verification alone.
    assert second.committed and second.verification == "engine-exact (sha256)+exact" and again == [[], []]


def test_a_parameter_the_sync_never_writes_fails_the_check_and_every_engine_stays_paused(
    reference_checkpoints, source, tmp_path
):
    dropped = "model.norm.weight"
    checkpoint, _ = load_checkpoint(reference_checkpoints / "target")
    with fresh_engines(reference_checkpoints, tmp_path, tp_sizes=(1, 1)) as proxies:
        urls = [p.url for p in proxies]

        async def main():
            await source.call("configure", settings(skip_names=(dropped,)))
            await source.call("step", 0)
            ctl = controller(urls, source, mechanism_check=True)
            await ctl.connect()
            try:
                with pytest.raises(SyncError) as failed:
                    await ctl.sync()
                paused = [await is_paused(u) for u in urls]
                # A request sent now does not complete: the engine holds random weights and never serves them.
                unserved = []
                for url in urls:
                    with contextlib.suppress(asyncio.TimeoutError):
                        unserved.append(await asyncio.wait_for(generate(url), timeout=2.0))
                held, serving = ctl.held_engines, ctl.serving_engines
                norms = [(await target_checksums(u))[dropped] for u in urls]
                calls = [control_calls(p) for p in proxies]
                # A later full sync writes every parameter, verifies and resumes them.
                await source.call("configure", settings())
                recovered = await ctl.sync()
                served = [await generate(u) for u in urls]
            finally:
                await ctl.close()
            return failed.value.report, paused, unserved, held, serving, norms, calls, recovered, served

        failure, paused, unserved, held, serving, norms, calls, recovered, served = asyncio.run(main())

    assert not failure.committed and "mechanism-compare failed on 2 of 2" in failure.error
    for url, engine in zip(urls, failure.engines):
        assert f"{url}: " in failure.error and f"target:{dropped}" in engine.message
        assert not engine.success and engine.is_stale and engine.weights_digest is None
    assert paused == [True, True] and unserved == []
    assert sorted(held) == sorted(urls) and serving == ()
    # The dropped parameter still holds the reset's random values: it is not the checkpoint's.
    assert all(n != tensor_checksum(checkpoint[dropped]) for n in norms)
    # Reset, synced, compared, and never resumed.
    for sequence in calls:
        checks = [f"checker:{a}" for a in CHECKER_ACTIONS]
        assert [c for c in sequence if c in checks] == checks
        assert "/end_weight_update" in sequence and "/continue_generation" not in sequence
    assert recovered.committed and recovered.verification == "exact"
    assert [r.meta_info.weight_version for r in served] == [recovered.version] * 2


def test_a_failure_after_the_reset_and_before_the_send_resumes_no_engine(reference_checkpoints, source, tmp_path):
    """Without the reset, a failure before the send resumes every engine on its old weights; after it, the old
    weights are gone: the engine whose begin succeeded stays paused as well as the one whose begin failed."""
    with fresh_engines(reference_checkpoints, tmp_path, tp_sizes=(1, 1)) as proxies:
        urls = [p.url for p in proxies]

        async def main():
            await source.call("configure", settings())
            await source.call("step", 0)
            ctl = controller(urls, source, mechanism_check=True)
            await ctl.connect()
            try:
                async with EngineClient(urls[1], timeout_s=20.0) as client:
                    await client.begin_weight_update(Selector.TARGET)  # the sync's own begin then fails there
                with pytest.raises(SyncError) as failed:
                    await ctl.sync()
                paused = [await is_paused(u) for u in urls]
                calls = [control_calls(p) for p in proxies]
            finally:
                await ctl.close()
            return failed.value.report, paused, calls

        failure, paused, calls = asyncio.run(main())

    assert not failure.committed and failure.num_bytes == 0 and failure.error.startswith("begin failed on 1 of 2")
    assert [e.is_stale for e in failure.engines] == [True, True] and paused == [True, True]
    assert "mechanism check reset its weights" in failure.engines[0].message
    for sequence in calls:
        assert "checker:reset_tensors" in sequence and "/continue_generation" not in sequence


def test_by_default_no_weights_checker_call_touches_the_weights(reference_checkpoints, source, tmp_path):
    with fresh_engines(reference_checkpoints, tmp_path, tp_sizes=(1,)) as proxies:

        async def main():
            await source.call("configure", settings())
            await source.call("step", 0)
            ctl = controller([proxies[0].url], source)  # a first sync at version 0: the check would apply
            await ctl.connect()
            try:
                return await ctl.sync()
            finally:
                await ctl.close()

        report = asyncio.run(main())
        touched = checker_requests(proxies[0])

    assert report.committed and report.version == "1" and report.verification == "exact"
    assert touched == []
