"""Failure handling that is safe on a real SGLang server, against reference engines that behave as SGLang does.

- A send cancelled between the metadata POST and the broadcast still broadcasts the bucket it announced, so every
  engine is released long before its collective timeout (and is then told the session failed).
- Engines that answer SGLang's engine-parameter digests (`--checksum-names engine`) are verified by replica
  agreement: a correct sync commits and says so; an engine whose bytes differ from its replicas' is named.
- No module of the package outside the wire records, the reference engine and the session (the opt-in mechanism
  check) names the reset_tensors action.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from reference_server import reference_server
from sender_host import SenderSettings, load_checkpoint

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.report import SyncError
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.transport.base import EngineTarget
from miles_sync.transport.distributed import DistributedTransport
from miles_sync.transport.membership import EngineEndpoint, plan_membership
from miles_sync.wire.bucket import pack_bucket
from miles_sync.wire.protocol import PauseMode, Selector

pytestmark = pytest.mark.multiproc

COLLECTIVE_TIMEOUT_S = 60.0  # what an abandoned receiver would wait: the test must finish far sooner
RELEASED_WITHIN_S = 15.0
FROZEN_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)


def start_engine(checkpoints: Path, log_dir: Path, *extra: str):
    return reference_server(
        model=checkpoints / "target",
        log_dir=log_dir,
        draft_kind="mtp",
        weight_layout="aiter",
        finalize_policy="strict",
        extra_args=("--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S), *extra),
    )


# Where the send is cancelled: after N loop iterations (0: as soon as it started), or after a delay in seconds.
CANCEL_POINTS = (0, 1, 3, 0.002, 0.01, 0.05)


@pytest.mark.slow
def test_a_send_cancelled_after_the_metadata_post_still_releases_every_engine(reference_checkpoints, tmp_path):
    tensors, _ = load_checkpoint(reference_checkpoints / "target")
    named = sorted((n, t) for n, t in tensors.items() if n.startswith("model.layers.0."))
    bucket = pack_bucket(named)

    async def cancel_at(point) -> None:
        if isinstance(point, int):
            for _ in range(point + 1):  # the first yield lets the send start
                await asyncio.sleep(0)
        else:
            await asyncio.sleep(point)

    async def main(urls):
        clients = [EngineClient(u, timeout_s=COLLECTIVE_TIMEOUT_S + 10) for u in urls]
        transport = DistributedTransport(engines=[EngineTarget(client=c, tp_size=1) for c in clients])
        membership = plan_membership(
            engines=[EngineEndpoint(url=u, tp_size=1) for u in urls],
            group_name="cancelled_send",
            backend="gloo",
            master_address="127.0.0.1",
        )
        await transport.open(membership=membership, timeout_s=30.0)
        released = []
        try:
            for point in CANCEL_POINTS:
                await asyncio.gather(*(c.begin_weight_update(Selector.TARGET) for c in clients))
                send = asyncio.create_task(
                    transport.send_bucket(bucket, selector=Selector.TARGET, timeout_s=COLLECTIVE_TIMEOUT_S)
                )
                await cancel_at(point)
                send.cancel()
                start = time.monotonic()
                with contextlib.suppress(asyncio.CancelledError):
                    await send  # a late cancel may find the send already done
                # end_weight_update needs the engine's weight lock, which a receive still blocked in the broadcast
                # would hold until the collective timeout. Under the strict policy it also fails unless the
                # bucket was loaded: success proves the announced bucket was delivered whole.
                await asyncio.wait_for(
                    asyncio.gather(*(c.end_weight_update(timeout_s=RELEASED_WITHIN_S) for c in clients)),
                    timeout=RELEASED_WITHIN_S,
                )
                released.append(time.monotonic() - start)
        finally:
            await transport.close(timeout_s=30.0)
            for client in clients:
                await client.close()
        return released

    with start_engine(reference_checkpoints, tmp_path) as a, start_engine(reference_checkpoints, tmp_path) as b:
        released = asyncio.run(main([a.url, b.url]))
    assert len(released) == len(CANCEL_POINTS) and max(released) < RELEASED_WITHIN_S


def sync_controller(urls, source) -> SyncController:
    return SyncController(
        engine_urls=urls,
        source=source,
        transport="distributed",
        selector_inputs=FROZEN_DRAFT,
        pause_mode=PauseMode.ABORT,
        verify=True,
        timeouts=SessionTimeouts(control_s=20.0, sync_s=90.0),
        show_progress=False,
    )


@pytest.mark.slow
def test_engine_named_digests_are_verified_by_replica_agreement(reference_checkpoints, source, tmp_path):
    """Three engines answering as SGLang does; the third stores its weights in another physical layout (as a
    mis-configured server would), so its bytes differ from its replicas' although every HTTP call succeeded. The
    source predicts no engine digests here (the engine-exact check is test_tp_engine.py's and test_engine_digests'),
    so agreement among replicas is the strongest check available."""

    async def main(urls):
        await source.call(
            "configure",
            SenderSettings(
                transport="distributed", bucket_bytes=256 * 1024, include_mtp=False, predict_engine_digests=False
            ),
        )
        ctl = sync_controller(urls[:2], source)
        await ctl.connect()
        try:
            await source.call("step", 2)
            agreed = await ctl.sync()
        finally:
            await ctl.close()
        ctl = sync_controller(urls, source)
        await ctl.connect()
        try:
            await source.call("step", 3)
            with pytest.raises(SyncError) as failed:
                await ctl.sync()
            held = ctl.held_engines
        finally:
            await ctl.close()
        return agreed, failed.value.report, held

    engine_names = ("--checksum-names", "engine")
    with (
        start_engine(reference_checkpoints, tmp_path, *engine_names) as a,
        start_engine(reference_checkpoints, tmp_path, *engine_names) as b,
        reference_server(
            model=reference_checkpoints / "target",
            log_dir=tmp_path,
            draft_kind="mtp",
            weight_layout="none",
            finalize_policy="strict",
            extra_args=(*engine_names,),
        ) as c,
    ):
        agreed, failure, held = asyncio.run(main([a.url, b.url, c.url]))
        urls = [a.url, b.url, c.url]
    assert agreed.committed and agreed.verification == "replica"
    assert all(e.verification == "replica" and e.num_verified_tensors > 0 for e in agreed.engines)
    assert not failure.committed and "verification failed" in failure.error
    results = {e.url: e for e in failure.engines}
    assert results[urls[0]].success and results[urls[1]].success
    assert results[urls[0]].verification == "replica"
    bad = results[urls[2]]
    assert not bad.success and bad.is_stale and "2 of them agree" in bad.message
    assert list(held) == [urls[2]]


def test_no_failure_path_can_name_reset_tensors():
    """reset_tensors is a test hook that randomizes SGLang's weights: only the wire records, the reference engine
    (which implements it) and the session may name it. The session sends it only for the opt-in mechanism check
    (snapshot, reset, sync, compare on a first sync), never on a failure path: once it is sent, every engine stays
    paused unless the sync verifies (tests/multiproc/test_mechanism_check.py)."""
    package = Path(__file__).resolve().parents[2] / "miles_sync"
    allowed = {package / "wire" / "protocol.py", package / "sync" / "session.py"}
    allowed |= set((package / "engine" / "reference").glob("*.py"))
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path not in allowed and ("reset_tensors" in path.read_text() or "RESET_TENSORS" in path.read_text())
    ]
    assert offenders == []
