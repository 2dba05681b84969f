"""Distributed updates over a real gloo group: the update group itself, and a sender broadcasting to 2 engines.

The pytest process is the trainer's source rank 0 (hosting the store); the engines are `serve` subprocesses at
ranks 1 and 2 that join through /init_weights_update_group, then receive per-tensor and flattened-bucket broadcasts.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from reference_server import checkpoint_tensors, checksums, generate, mtp_names, reference_server

from miles_sync.transport.group import create_update_group, start_store_server
from miles_sync.weights.checksum import role_checksums
from miles_sync.wire.bucket import pack_bucket
from miles_sync.wire.dtypes import dtype_name

GROUP = "sync-test-group"
TIMEOUT_S = 60.0

# ---- the update group on its own ----------------------------------------------------------------------------------

_PAYLOADS = [
    torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
    torch.linspace(-3, 3, 10).to(torch.bfloat16),
    torch.linspace(-3, 3, 8).to(torch.float8_e4m3fn),  # gloo has no float8 kernels: bytes travel as uint8
    torch.tensor([2**40, -5], dtype=torch.int64),
    torch.tensor(1.5),
    torch.empty(0, 3),
]


def _group_member(port: int, rank: int, store_file: str, results) -> None:
    torch.set_num_threads(1)
    try:
        # A default group first (world size 1): the update group must coexist with it.
        torch.distributed.init_process_group("gloo", init_method=f"file://{store_file}", rank=0, world_size=1)
        group = create_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=rank,
            world_size=3,
            group_name=GROUP,
            backend="gloo",
            timeout_s=TIMEOUT_S,
        )
        received = []
        for expected in _PAYLOADS:
            buffer = torch.empty_like(expected)
            group.broadcast(buffer, src=0, timeout_s=TIMEOUT_S)
            received.append(buffer)
        results.put((rank, "bytes", [_bytes(t) for t in received]))
        if rank == 1:
            started = time.monotonic()
            try:
                group.broadcast(torch.empty(4), src=0, timeout_s=1.0)  # nobody sends
                results.put((rank, "timeout", None))
            except TimeoutError as error:
                results.put((rank, "timeout", (time.monotonic() - started, str(error))))
            try:
                group.broadcast(torch.empty(4), src=0, timeout_s=1.0)
            except RuntimeError as error:
                results.put((rank, "after", str(error)))
        group.destroy()
        torch.distributed.destroy_process_group()
    except Exception as error:  # reported to the test, which fails with it
        results.put((rank, "error", repr(error)))


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_update_group_broadcasts_exact_bytes_coexists_and_times_out(tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store = start_store_server(host="127.0.0.1", timeout_s=TIMEOUT_S)
    members = [
        context.Process(target=_group_member, args=(store.port, rank, str(tmp_path / f"default-{rank}"), results))
        for rank in (1, 2)
    ]
    for member in members:
        member.start()
    try:
        group = create_update_group(
            master_address="127.0.0.1",
            master_port=store.port,
            rank=0,
            world_size=3,
            group_name=GROUP,
            backend="gloo",
            timeout_s=TIMEOUT_S,
            store=store,
        )
        for payload in _PAYLOADS:
            group.broadcast(payload.clone(), src=0, timeout_s=TIMEOUT_S)
        reports = [results.get(timeout=TIMEOUT_S) for _ in range(4)]
    finally:
        for member in members:
            member.join(TIMEOUT_S)
            if member.is_alive():
                member.kill()
    group.destroy()
    by_kind = {(rank, kind): value for rank, kind, value in reports}
    assert not [v for (_, k), v in by_kind.items() if k == "error"], by_kind
    for rank in (1, 2):
        assert by_kind[(rank, "bytes")] == [_bytes(p) for p in _PAYLOADS]
    waited, message = by_kind[(1, "timeout")]
    assert 0.9 <= waited < 10 and "timed out" in message
    assert "unusable" in by_kind[(1, "after")]


def test_update_group_creation_times_out_without_its_peers():
    store = start_store_server(host="127.0.0.1", timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not rendezvous"):
        create_update_group(
            master_address="127.0.0.1",
            master_port=store.port,
            rank=0,
            world_size=2,
            group_name="lonely",
            backend="gloo",
            timeout_s=1.0,
            store=store,
        )
    assert time.monotonic() - started < 10


def test_update_group_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank 3 is outside") as info:
        create_update_group(
            master_address="127.0.0.1",
            master_port=70000,
            rank=3,
            world_size=2,
            group_name="",
            backend="mpi",
            timeout_s=0,
        )
    message = str(info.value)
    assert all(s in message for s in ("backend 'mpi'", "master_port 70000", "group_name is empty", "timeout_s 0"))


# ---- a sender and two engines -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(reference_checkpoints, tmp_path_factory):
    """Two MTP engines (AITER and plain layout) joined with this process into one update group."""
    target = reference_checkpoints / "target"
    log_dir = tmp_path_factory.mktemp("distributed")
    with (
        reference_server(model=target, draft_kind="mtp", weight_layout="aiter", log_dir=log_dir) as aiter_engine,
        reference_server(model=target, draft_kind="mtp", weight_layout="none", log_dir=log_dir) as plain_engine,
        ThreadPoolExecutor(4) as pool,
    ):
        engines = [aiter_engine, plain_engine]
        store = start_store_server(host="127.0.0.1", timeout_s=TIMEOUT_S)
        joins = [
            pool.submit(
                engine.post,
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": store.port,
                    "rank_offset": rank,
                    "world_size": 3,
                    "group_name": GROUP,
                    "backend": "gloo",
                },
            )
            for rank, engine in enumerate(engines, start=1)
        ]
        group = create_update_group(
            master_address="127.0.0.1",
            master_port=store.port,
            rank=0,
            world_size=3,
            group_name=GROUP,
            backend="gloo",
            timeout_s=TIMEOUT_S,
            store=store,
        )
        for join in joins:
            status, answer = join.result(TIMEOUT_S)
            assert status == 200, answer
        try:
            yield engines, group, pool
        finally:
            for engine in engines:
                engine.post("/destroy_weights_update_group", {"group_name": GROUP})
            group.destroy()


def send(engines, group, pool, named, *, selector: str, flattened: bool) -> None:
    """One payload: POST the metadata to every engine, then broadcast (once per bucket, or once per tensor)."""
    if flattened:
        bucket = pack_bucket(named)
        order = [(e.name, e.dtype, e.shape) for e in bucket.entries]
    else:
        order = [(n, t.dtype, tuple(t.shape)) for n, t in named]
    body = {
        "names": [n for n, _, _ in order],
        "dtypes": [dtype_name(d) for _, d, _ in order],
        "shapes": [list(s) for _, _, s in order],
        "group_name": GROUP,
        "load_format": "flattened_bucket" if flattened else None,
        "selector": selector,
    }
    posts = [
        pool.submit(engine.post, "/update_weights_from_distributed", body, timeout_s=TIMEOUT_S) for engine in engines
    ]
    if flattened:
        group.broadcast(bucket.buffer, src=0, timeout_s=TIMEOUT_S)
    else:
        for _, tensor in named:
            group.broadcast(tensor.contiguous(), src=0, timeout_s=TIMEOUT_S)
    for post in posts:
        status, answer = post.result(TIMEOUT_S)
        assert status == 200, answer


def _session(engines, pool, endpoint: str, body=None) -> None:
    for status, answer in pool.map(lambda e: e.post(endpoint, body), engines):
        assert status == 200, answer


def test_flattened_buckets_reach_both_engines_and_the_draft_picks_its_names(reference_checkpoints, fleet):
    engines, group, pool = fleet
    target = reference_checkpoints / "target"
    tensors = checkpoint_tensors(target)
    draft_names = mtp_names(target)
    # New values for everything, target and MTP layer interleaved in the same buckets.
    new = sorted((n, (t * 0.75 + 0.01).to(t.dtype)) for n, t in tensors.items())
    half = len(new) // 2
    _session(engines, pool, "/begin_weight_update", {"selector": "all"})
    send(engines, group, pool, new[:half], selector="all", flattened=True)
    send(engines, group, pool, new[half:], selector="all", flattened=True)
    _session(engines, pool, "/end_weight_update")
    expected = {
        **role_checksums([(n, t) for n, t in new if n not in draft_names], role="target"),
        **role_checksums([(n, t) for n, t in new if n in draft_names], role="draft"),
    }
    for engine in engines:
        assert checksums(engine, "all") == expected
        assert generate(engine, [3, 32])[0] == 200

    # Restore the checkpoint one tensor per broadcast, in request order.
    original = sorted(tensors.items())
    _session(engines, pool, "/begin_weight_update", {"selector": "all"})
    send(engines, group, pool, original, selector="all", flattened=False)
    _session(engines, pool, "/end_weight_update")
    restored = {
        **role_checksums([(n, t) for n, t in original if n not in draft_names], role="target"),
        **role_checksums([(n, t) for n, t in original if n in draft_names], role="draft"),
    }
    for engine in engines:
        assert checksums(engine, "all") == restored


def test_selector_target_leaves_the_draft_alone(reference_checkpoints, fleet):
    engines, group, pool = fleet
    target = reference_checkpoints / "target"
    draft_names = mtp_names(target)
    target_only = sorted((n, t) for n, t in checkpoint_tensors(target).items() if n not in draft_names)
    before = [checksums(engine, "draft") for engine in engines]
    _session(engines, pool, "/begin_weight_update", {"selector": "target"})
    send(engines, group, pool, target_only, selector="target", flattened=True)
    _session(engines, pool, "/end_weight_update")
    assert [checksums(engine, "draft") for engine in engines] == before
    for engine in engines:
        assert checksums(engine, "target") == role_checksums(target_only, role="target")
