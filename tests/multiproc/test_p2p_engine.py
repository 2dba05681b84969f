"""SGLang's `--custom-weight-loader` hook on reference engines at TP=1 and TP=2 (real `serve` processes over HTTP),
driven with miles_sync's p2p loader: the update's payloads are tickets (inline bytes, no shared memory), every TP
rank joins a gloo channel with two trainer ranks (threads of this test) and receives its own engine-layout tensors
point to point, each checked against the digest its source sent; the engine's checker then answers exactly the
sent tensors' digests. A load_format outside the engine's allow-list crashes it, as SGLang's scheduler dies on
`NotImplementedError: Unknown load_format` (tests/sglang/test_p2p_sglang.py holds the real server to both)."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from reference_server import generate, reference_server

from miles_sync.transport.group import create_update_group, start_store_server
from miles_sync.transport.p2p_loader import (
    LOADER_PATH,
    TICKET_NAME,
    ChannelSpec,
    ParamTicket,
    Refusal,
    Status,
    Ticket,
    digests_tensor,
    encode_ticket,
    send_params,
)
from miles_sync.weights.engine_layout import rank_engine_digests, rank_engine_tensors
from miles_sync.wire.payload import encode_inline_named_tensors

HOST = "127.0.0.1"
TIMEOUT_S = 60.0
TRAINER_RANKS = 2
CRASH_EXIT_CODE = 70
_GROUPS = itertools.count()


@pytest.fixture(scope="module")
def engines(reference_checkpoints, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("p2p-engine")
    target = reference_checkpoints / "target"
    hook = ["--custom-weight-loader", LOADER_PATH]
    with (
        reference_server(model=target, log_dir=log_dir, checksum_names="engine", extra_args=hook) as tp1,
        reference_server(model=target, log_dir=log_dir, extra_args=[*hook, "--tp-size", "2"]) as tp2,
    ):
        yield {1: tp1, 2: tp2}


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in sorted(weights.items())}


def assignment(names: list[str], tp_rank: int, tp_size: int) -> dict[str, int]:
    """Which trainer rank sends each of engine rank `tp_rank`'s parameters: at TP=2 rank r's all from trainer rank r,
    at TP=1 alternately from both (an engine rank fed by two sources)."""
    if tp_size == TRAINER_RANKS:
        return {n: tp_rank for n in names}
    return {n: i % TRAINER_RANKS for i, n in enumerate(names)}


def p2p_update(server, per_rank: list[dict[str, torch.Tensor]], *, corrupt: str | None = None) -> list[Status]:
    """One session: begin, one update whose payloads are tickets, end; the trainer ranks (threads) join the channel
    and send while the engine's ranks receive. Returns every (trainer rank, engine rank) status."""
    tp_size = len(per_rank)
    store = start_store_server(host=HOST, timeout_s=TIMEOUT_S)
    world = TRAINER_RANKS + tp_size
    name = f"p2p-engine-test-{next(_GROUPS)}"
    sources = [assignment(list(tensors), r, tp_size) for r, tensors in enumerate(per_rank)]
    payloads = []
    for r, tensors in enumerate(per_rank):
        spec = ChannelSpec(
            group_name=name, master_address=HOST, master_port=store.port, world_size=world, rank=TRAINER_RANKS + r
        )
        params = tuple(
            ParamTicket(name=n, source=sources[r][n], shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
            for n, t in tensors.items()
        )
        payloads.append(
            encode_inline_named_tensors([(TICKET_NAME, encode_ticket(Ticket(channel=spec, params=params)))])
        )

    def trainer(rank: int) -> dict[int, Status]:
        group = create_update_group(
            master_address=HOST,
            master_port=store.port,
            rank=rank,
            world_size=world,
            group_name=name,
            backend="gloo",
            timeout_s=TIMEOUT_S,
            store=store if rank == 0 else None,
        )
        try:
            sends = {}
            for r, tensors in enumerate(per_rank):
                mine = [t.contiguous().clone() for n, t in tensors.items() if sources[r][n] == rank]
                if mine:
                    sends[TRAINER_RANKS + r] = mine
            if corrupt is None or rank != 0:
                return send_params(group, sends, timeout_s=TIMEOUT_S)
            # As send_params, with one tensor's bit flipped after its digest was taken: what a bad link does.
            wired = {k: [*v, digests_tensor(v, device=group.device)] for k, v in sends.items()}
            r = next(r for r in range(tp_size) if sources[r].get(corrupt) == 0)
            index = [n for n in per_rank[r] if sources[r][n] == 0].index(corrupt)
            wired[TRAINER_RANKS + r][index].view(-1).view(torch.uint8)[0] ^= 1
            group.exchange(sends=wired, timeout_s=TIMEOUT_S)
            statuses = {k: Status.empty(group.device) for k in sends}
            group.exchange(recvs={k: [t] for k, t in statuses.items()}, timeout_s=TIMEOUT_S)
            return {k: Status.from_tensor(t) for k, t in statuses.items()}
        finally:
            group.destroy()

    server.ok("/begin_weight_update", {"selector": "target"})
    with ThreadPoolExecutor(max_workers=TRAINER_RANKS + 1) as pool:
        update = pool.submit(
            server.post,
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": payloads,
                "load_format": LOADER_PATH,
                "flush_cache": True,
                "selector": "target",
            },
            timeout_s=TIMEOUT_S,
        )
        trainers = [pool.submit(trainer, rank) for rank in range(TRAINER_RANKS)]
        statuses = [s for t in trainers for _, s in sorted(t.result(timeout=TIMEOUT_S).items())]
        status, body = update.result(timeout=TIMEOUT_S)
    assert status == 200 and body["success"], body
    server.ok("/end_weight_update")
    return statuses


def answered_digests(server) -> list[dict[str, str]]:
    return [
        rank["checksums"]
        for rank in server.ok("/weights_checker", {"action": "checksum", "selector": "target"})["ranks"]
    ]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_every_rank_receives_its_own_tensors_point_to_point_and_serves_them(
    engines, target_runner_weights, shape, tp_size
):
    server = engines[tp_size]
    for seed in (tp_size, 10 + tp_size):  # twice: the second sync's channel is a fresh group on the same engine
        weights = perturbed(target_runner_weights, seed=seed)
        per_rank = [rank_engine_tensors(weights, shape=shape, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
        statuses = p2p_update(server, per_rank)
        assert all(s.refusal is Refusal.NONE for s in statuses) and sum(s.checked for s in statuses) == sum(
            len(t) for t in per_rank
        ), statuses
        assert answered_digests(server) == list(
            rank_engine_digests([("target", weights)], shape=shape, tp_size=tp_size)
        )
    status, answer = generate(server, [3, 100, 7])
    assert status == 200 and len(answer["output_ids"]) == 4, answer


def test_a_corrupted_tensor_is_refused_by_the_engine_rank_and_named(engines, target_runner_weights, shape):
    server = engines[2]
    weights = perturbed(target_runner_weights, seed=5)
    per_rank = [rank_engine_tensors(weights, shape=shape, tp_rank=r, tp_size=2) for r in range(2)]
    victim = "model.layers.0.mlp.down_proj.weight"
    statuses = p2p_update(server, per_rank, corrupt=victim)
    refused = [s for s in statuses if s.refusal is not Refusal.NONE]
    assert [s.refusal for s in refused] == [Refusal.DIGEST]
    assert list(per_rank[0])[refused[0].refused_index] == victim
    assert answered_digests(server) != list(rank_engine_digests([("target", weights)], shape=shape, tp_size=2))


def test_a_load_format_outside_the_allow_list_crashes_the_engine(reference_checkpoints, tmp_path):
    with reference_server(model=reference_checkpoints / "target", log_dir=tmp_path) as server:
        server.ok("/begin_weight_update", {"selector": "target"})
        ticket = encode_inline_named_tensors([(TICKET_NAME, torch.zeros(3, dtype=torch.uint8))])
        body = {"serialized_named_tensors": [ticket], "load_format": LOADER_PATH, "selector": "target"}
        with pytest.raises(OSError):  # no answer: the server is gone
            server.post("/update_weights_from_tensor", body, timeout_s=30.0)
        assert server.process.wait(timeout=30) == CRASH_EXIT_CODE
        assert f"Unknown load_format={LOADER_PATH}" in server.log_path.read_text(errors="replace")
