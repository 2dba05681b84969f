"""One p2p update session driven by hand, for the engine-level tests (reference engines and real SGLang servers
alike): trainer ranks are threads of the test process that join the update's channel and send each engine rank
its own engine-layout tensors point to point (miles_sync.transport.p2p_loader), while the update's payloads are
inline tickets posted with load_format = the loader's import path."""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from miles_sync.transport.group import create_update_group, start_store_server
from miles_sync.transport.p2p_loader import (
    LOADER_PATH,
    TICKET_NAME,
    ChannelSpec,
    ParamTicket,
    Status,
    Ticket,
    digests_tensor,
    encode_ticket,
    send_params,
)
from miles_sync.wire.payload import encode_inline_named_tensors

HOST = "127.0.0.1"
TIMEOUT_S = 60.0
TRAINER_RANKS = 2
_GROUPS = itertools.count()


def post(url: str, path: str, body: dict | None = None, *, timeout_s: float = TIMEOUT_S) -> tuple[int, object]:
    """(status, parsed body); raises OSError when the server answers nothing."""
    data = json.dumps({} if body is None else body).encode()
    request = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def assignment(names: list[str], tp_rank: int, tp_size: int) -> dict[str, int]:
    """Which trainer rank sends each of engine rank `tp_rank`'s parameters: at TP=2 rank r's all from trainer rank r,
    at TP=1 alternately from both (an engine rank fed by two sources)."""
    if tp_size == TRAINER_RANKS:
        return {n: tp_rank for n in names}
    return {n: i % TRAINER_RANKS for i, n in enumerate(names)}


def p2p_update(url: str, per_rank: list[dict[str, torch.Tensor]], *, corrupt: str | None = None) -> list[Status]:
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
            # The trainer rank that sends `corrupt` to engine rank 0 flips one bit of it after taking its digest.
            if corrupt is None or sources[0].get(corrupt) != rank:
                return send_params(group, sends, timeout_s=TIMEOUT_S)
            wired = {k: [*v, digests_tensor(v, device=group.device)] for k, v in sends.items()}
            index = [n for n in per_rank[0] if sources[0][n] == rank].index(corrupt)
            wired[TRAINER_RANKS][index].view(-1).view(torch.uint8)[0] ^= 1  # what a bad link does
            group.exchange(sends=wired, timeout_s=TIMEOUT_S)
            statuses = {k: Status.empty(group.device) for k in sends}
            group.exchange(recvs={k: [t] for k, t in statuses.items()}, timeout_s=TIMEOUT_S)
            return {k: Status.from_tensor(t) for k, t in statuses.items()}
        finally:
            group.destroy()

    assert post(url, "/begin_weight_update", {"selector": "target"})[0] == 200
    with ThreadPoolExecutor(max_workers=TRAINER_RANKS + 1) as pool:
        update = pool.submit(
            post,
            url,
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
    assert post(url, "/end_weight_update")[0] == 200
    return statuses
