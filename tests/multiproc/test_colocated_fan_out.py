"""The colocated fan-out's failure paths over a real gloo group: two trainer processes (rank 0 the export source,
rank j feeding and posting engine j), real Senders, engines that refuse connections. A failure on either rank
ends the send on both ranks promptly (well inside the collectives' timeouts), reported once, by the source."""

from __future__ import annotations

import multiprocessing
import socket
import time
from datetime import timedelta

import pytest

BUCKET_TIMEOUT_S = 10.0  # the fan-out's collectives wait at most twice this
NUM_TENSORS = 6


def closed_port_url() -> str:
    """A loopback URL nobody listens on: a POST there fails at once (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def run_rank(rank: int, port: int, urls: list[str], fail_export_at: int | None, results) -> None:
    """Process entry point (spawn): join the gloo group, open a Sender with this rank's feed role, send once."""
    import asyncio

    import torch
    import torch.distributed as dist

    from miles_sync.export.units import units_from_hf_tensors
    from miles_sync.sync.sender import Sender, SenderSettings
    from miles_sync.transport.feeds import Device, FeedRole, plan_feeds
    from miles_sync.transport.membership import EngineEndpoint
    from miles_sync.wire.protocol import Selector

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    tensors = {f"model.layers.{i}.mlp.down_proj.weight": torch.full((64, 256), float(i)) for i in range(NUM_TENSORS)}

    def export():
        for index, unit in enumerate(units_from_hf_tensors(tensors, sorted(tensors))):
            if rank == 0 and index == fail_export_at:
                raise RuntimeError(f"export failed at unit {index}")
            yield unit

    devices = [Device(node="127.0.0.1", index=i) for i in range(2)]
    plan = plan_feeds(trainer_devices=devices, engine_devices=[[d] for d in devices])
    settings = SenderSettings(
        transport="colocated",
        bucket_bytes=2 * 64 * 256 * 4,
        bucket_timeout_s=BUCKET_TIMEOUT_S,
        open_timeout_s=BUCKET_TIMEOUT_S,
        http_timeout_s=BUCKET_TIMEOUT_S,
        call_timeout_s=4 * BUCKET_TIMEOUT_S,
    )
    sender = Sender(
        settings=settings,
        export=export,
        names=lambda: sorted(tensors),
        is_source=rank == 0,
        feeds=FeedRole(plan=plan, rank=rank, source_rank=0),
    )

    async def main() -> str | None:
        await sender.open(engines=[EngineEndpoint(url=u, tp_size=1) for u in urls], membership=None)
        try:
            await sender.send(selector=Selector.TARGET)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            await sender.close()
        return None

    start = time.monotonic()
    error = asyncio.run(main())
    results.put((rank, error, time.monotonic() - start))
    dist.destroy_process_group()


def run_pair(urls: list[str], *, fail_export_at: int | None = None) -> dict[int, tuple[str | None, float]]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [
        context.Process(target=run_rank, args=(rank, port, urls, fail_export_at, results), daemon=True)
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    try:
        answers = [results.get(timeout=120) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return {rank: (error, seconds) for rank, error, seconds in answers}


@pytest.fixture(scope="module")
def refused_urls() -> list[str]:
    return [closed_port_url(), closed_port_url()]


def test_a_post_failure_on_another_rank_fails_the_bucket_on_the_source(refused_urls):
    outcome = run_pair(refused_urls)
    source_error, source_s = outcome[0]
    follower_error, follower_s = outcome[1]
    # Each engine was posted by its own feeder: the source names both, rank 1's included.
    assert source_error is not None and source_error.startswith("TransportError")
    assert refused_urls[0] in source_error and refused_urls[1] in source_error
    assert follower_error is None  # reported once, by the source
    assert source_s < BUCKET_TIMEOUT_S and follower_s < BUCKET_TIMEOUT_S


def test_a_failing_export_on_the_source_releases_the_other_rank(refused_urls):
    outcome = run_pair(refused_urls, fail_export_at=0)
    source_error, source_s = outcome[0]
    follower_error, follower_s = outcome[1]
    assert source_error is not None and "export failed at unit 0" in source_error
    assert follower_error is None
    assert source_s < BUCKET_TIMEOUT_S and follower_s < BUCKET_TIMEOUT_S
