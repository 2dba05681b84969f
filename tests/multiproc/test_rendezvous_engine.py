"""A TP=2 reference engine joins an update group created the way SGLang's own trainers create it, then takes an update.

SGLang's trainers (and its tests) build the group with `init_custom_process_group` (sglang/srt/utils/common.py):
torch's `rendezvous("tcp://host:port", rank 0, world_size)` gives a master `TCPStore` built with the world size,
whose constructor waits until every worker registered; the gloo group is then `_new_process_group_helper` over
`PrefixStore(group_name, store)`. The test process runs that code (replicated here: sglang is not imported) as rank
0 of 3, while the engine's two TP ranks join through POST /init_weights_update_group (rank_offset 1) from a thread.
One begin / update_weights_from_distributed / end session then broadcasts `model.norm.weight` from rank 0 with
`torch.distributed.broadcast`, and both ranks' checker answers and the greedy output show the new weight. Loopback
only (see `_loopback_server`); every wait is bounded by 30 s, the engine's start-up by 60 s.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist
from reference_server import checkpoint_tensors, generate, reference_server
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from miles_sync.weights.checksum import sglang_tensor_hash
from miles_sync.wire.dtypes import dtype_name

HOST = "127.0.0.1"
GROUP = "sglang-style-rendezvous-group"
WORLD_SIZE = 3  # this process, then the engine's TP ranks 1 and 2
TIMEOUT_S = 30.0
NAME = "model.norm.weight"
PROMPT = [3, 40, 77, 120]


def _loopback_server(*, timeout_s: float) -> dist.TCPStore:
    """A store server on a loopback port the OS picks, shared by every multi-tenant store of this process on that
    port. torch's tcp:// rendezvous builds its master as such a store (`multi_tenant=True`), so it reuses this
    server instead of listening on every interface, as it would on its own; the rendezvous still counts and waits
    for the workers itself (this holder registers as no worker: it has no world size)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    listener.listen(socket.SOMAXCONN)
    return dist.TCPStore(
        HOST,
        listener.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),
    )


def _sglang_custom_process_group(*, init_method: str, rank: int, world_size: int, group_name: str, timeout_s: float):
    """SGLang 0.5.23's `init_custom_process_group` for backend gloo, store None, no pg options, no device id."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend("gloo"),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
        device_id=None,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _rank_checksums(server) -> list[dict[str, str]]:
    answer = server.ok("/weights_checker", {"action": "checksum", "selector": "target"}, timeout_s=TIMEOUT_S)
    return [rank["checksums"] for rank in answer["ranks"]]


@pytest.mark.slow  # starts a TP=2 engine (three processes): the full run keeps it, the quick loop skips it
@pytest.mark.timeout(120)  # engine start-up (up to 60 s) plus the bounded group and session
def test_an_sglang_style_master_waits_for_both_engine_ranks_then_broadcasts_an_update(reference_checkpoints, tmp_path):
    target = reference_checkpoints / "target"
    new = (-checkpoint_tensors(target)[NAME]).contiguous()  # negated final norm: negated logits, other tokens
    with (
        reference_server(
            model=target, log_dir=tmp_path, extra_args=("--tp-size", "2"), startup_timeout_s=60.0
        ) as server,
        ThreadPoolExecutor(1) as pool,
    ):
        before = _rank_checksums(server)
        status, answer = generate(server, PROMPT, max_new_tokens=8, timeout_s=TIMEOUT_S)
        assert status == 200, answer
        output_before = answer["output_ids"]
        loopback_store = _loopback_server(timeout_s=TIMEOUT_S)
        port = loopback_store.port
        join_body = {
            "master_address": HOST,
            "master_port": port,
            "rank_offset": 1,
            "world_size": WORLD_SIZE,
            "group_name": GROUP,
            "backend": "gloo",
        }
        # The engine answers once the group exists on both its ranks, which needs this rank too: join from a thread.
        join = pool.submit(server.post, "/init_weights_update_group", join_body, timeout_s=TIMEOUT_S)
        pg = _sglang_custom_process_group(
            init_method=f"tcp://{HOST}:{port}", rank=0, world_size=WORLD_SIZE, group_name=GROUP, timeout_s=TIMEOUT_S
        )
        try:
            status, answer = join.result(TIMEOUT_S)
            assert status == 200, answer

            server.ok("/begin_weight_update", {"selector": "target"}, timeout_s=TIMEOUT_S)
            update_body = {
                "names": [NAME],
                "dtypes": [dtype_name(new.dtype)],
                "shapes": [list(new.shape)],
                "group_name": GROUP,
                "load_format": None,
                "selector": "target",
            }
            update = pool.submit(server.post, "/update_weights_from_distributed", update_body, timeout_s=TIMEOUT_S)
            # As SGLang's trainers send: torch.distributed.broadcast on the custom group, from rank 0.
            work = dist.broadcast(new, src=0, group=pg, async_op=True)
            assert work.wait(timedelta(seconds=TIMEOUT_S)), "broadcast did not complete"
            status, answer = update.result(TIMEOUT_S)
            assert status == 200, answer
            status, answer = server.post("/end_weight_update", timeout_s=TIMEOUT_S)
            assert status == 200, answer
        finally:
            server.post("/destroy_weights_update_group", {"group_name": GROUP}, timeout_s=TIMEOUT_S)
            dist.destroy_process_group(pg)

        after = _rank_checksums(server)
        assert len(after) == 2
        for rank_before, rank_after in zip(before, after, strict=True):
            assert rank_after[NAME] == sglang_tensor_hash(new) != rank_before[NAME]
            assert {n: d for n, d in rank_after.items() if n != NAME} == {
                n: d for n, d in rank_before.items() if n != NAME
            }
        status, answer = generate(server, PROMPT, max_new_tokens=8, timeout_s=TIMEOUT_S)
        assert status == 200, answer
        assert answer["output_ids"] != output_before
