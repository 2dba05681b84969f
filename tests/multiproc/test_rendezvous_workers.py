"""Engine-side ranks rendezvous the way SGLang's processes do: they register with the master store.

torch's tcp:// rendezvous (behind SGLang's `init_custom_process_group`) builds every `TCPStore` with the world size,
and the master, built with `wait_for_workers=True`, blocks until every worker registered. Our engine ranks join
through `create_update_group` in subprocesses; the master is either such an SGLang-style store or our own
`start_store_server`, and the group then broadcasts across all 3 ranks.
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from miles_sync.transport.group import create_update_group, start_store_server

HOST = "127.0.0.1"
GROUP = "rendezvous-test-group"
WORLD_SIZE = 3
TIMEOUT_S = 30.0
PAYLOAD = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7


def _worker(port: int, rank: int, results) -> None:
    torch.set_num_threads(1)
    try:
        group = create_update_group(
            master_address=HOST,
            master_port=port,
            rank=rank,
            world_size=WORLD_SIZE,
            group_name=GROUP,
            backend="gloo",
            timeout_s=TIMEOUT_S,
        )
        buffer = torch.empty_like(PAYLOAD)
        group.broadcast(buffer, src=0, timeout_s=TIMEOUT_S)
        group.destroy()
        results.put((rank, buffer.tolist()))
    except Exception as error:  # reported to the test, which fails with it
        results.put((rank, f"error: {error!r}"))


def _sglang_style_master(listener: socket.socket) -> dist.TCPStore:
    """The store torch's tcp:// rendezvous builds on rank 0, bound to loopback: blocks until all workers registered."""
    return dist.TCPStore(
        HOST,
        listener.getsockname()[1],
        world_size=WORLD_SIZE,
        is_master=True,
        wait_for_workers=True,
        timeout=timedelta(seconds=TIMEOUT_S),
        master_listen_fd=listener.detach(),
    )


def _loopback_listener() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    listener.listen(socket.SOMAXCONN)
    return listener


@pytest.mark.parametrize("master", ["sglang_style", "start_store_server"])
def test_engine_ranks_register_with_the_master_and_broadcast(master):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with ThreadPoolExecutor(1) as pool:
        if master == "sglang_style":
            listener = _loopback_listener()
            port = listener.getsockname()[1]
            # The constructor blocks until both workers registered, so it runs beside them, not before them.
            pending = pool.submit(_sglang_style_master, listener)
        else:
            store = start_store_server(host=HOST, timeout_s=TIMEOUT_S)
            port = store.port
        workers = [context.Process(target=_worker, args=(port, rank, results)) for rank in (1, 2)]
        for worker in workers:
            worker.start()
        try:
            if master == "sglang_style":
                store = pending.result(timeout=TIMEOUT_S + 10)  # raises DistStoreError if a worker never registered
            group = create_update_group(
                master_address=HOST,
                master_port=port,
                rank=0,
                world_size=WORLD_SIZE,
                group_name=GROUP,
                backend="gloo",
                timeout_s=TIMEOUT_S,
                store=store,
            )
            group.broadcast(PAYLOAD.clone(), src=0, timeout_s=TIMEOUT_S)
            reports = dict(results.get(timeout=TIMEOUT_S) for _ in workers)
            group.destroy()
        finally:
            for worker in workers:
                worker.join(TIMEOUT_S)
                if worker.is_alive():
                    worker.kill()
    assert reports == {1: PAYLOAD.tolist(), 2: PAYLOAD.tolist()}


def test_a_client_without_world_size_leaves_a_waiting_master_waiting():
    """Why the world size matters: the torch behaviour the engine's join depends on (a canary for torch upgrades)."""
    listener = _loopback_listener()
    port = listener.getsockname()[1]
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            dist.TCPStore,
            HOST,
            port,
            world_size=2,
            is_master=True,
            wait_for_workers=True,
            timeout=timedelta(seconds=2),
            master_listen_fd=listener.detach(),
        )
        client = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=10))
        with pytest.raises(dist.DistStoreError, match="waiting for clients"):
            pending.result(timeout=20)
    del client
    assert time.monotonic() - started < 20
