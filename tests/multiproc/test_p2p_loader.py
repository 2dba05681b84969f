"""The p2p transport's engine-side loader (miles_sync.transport.p2p_loader) over a real gloo channel: two trainer
ranks send their parameters point to point into a model's own tensors; the loader checks each digest, answers each
source with a status, refuses a corrupted or unknown parameter by its index, survives a source that never sends
(its channel dropped within the ticket's timeout, nothing raised) and joins again from the next ticket; keeps one
channel per slot (pipeline stages feed an engine rank over channels of their own).

Every rank is a thread of this process with its own gloo process group (the channel is a real torch.distributed
group on loopback with its own TCP store, as on a cluster)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from miles_sync.transport.group import UpdateGroup, create_update_group, start_store_server
from miles_sync.transport.p2p_loader import (
    DIGEST_BYTES,
    TICKET_NAME,
    ChannelSpec,
    ParamTicket,
    Receiver,
    Refusal,
    Status,
    Ticket,
    decode_ticket,
    digests_tensor,
    encode_ticket,
)

HOST = "127.0.0.1"
TIMEOUT_S = 20.0
ENGINE_RANK = 2  # trainer ranks 0 and 1, the engine rank last
_GROUPS = itertools.count()


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(3, 4, bias=False, dtype=torch.bfloat16)  # weight (4, 3) bf16
        self.norm = torch.nn.Parameter(torch.zeros(5))  # f32


class StridedModel:
    """A model whose parameter is not contiguous: the loader receives into a buffer and copies it in."""

    def __init__(self) -> None:
        self.storage = torch.zeros(3, 4)
        self.weight = self.storage.t()  # (4, 3), not contiguous

    def get_parameter(self, target: str) -> torch.Tensor:
        if target != "weight":
            raise AttributeError(target)
        return self.weight


def sent_values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "qkv.weight": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "norm": torch.randn(5, generator=g),
    }


class Channel:
    """A gloo channel of two trainer ranks (threads) and one engine rank (the receiver, on its own thread)."""

    def __init__(self) -> None:
        self.store = start_store_server(host=HOST, timeout_s=TIMEOUT_S)
        self.spec = ChannelSpec(
            group_name=f"p2p-loader-test-{next(_GROUPS)}",
            master_address=HOST,
            master_port=self.store.port,
            world_size=3,
            rank=ENGINE_RANK,
            timeout_s=TIMEOUT_S,
        )
        self.pool = ThreadPoolExecutor(max_workers=3)
        self.trainers: list[UpdateGroup] = []

    def join_trainers(self) -> list:
        def join(rank: int) -> UpdateGroup:
            return create_update_group(
                master_address=HOST,
                master_port=self.spec.master_port,
                rank=rank,
                world_size=3,
                group_name=self.spec.group_name,
                backend="gloo",
                timeout_s=TIMEOUT_S,
                store=self.store if rank == 0 else None,
            )

        return [self.pool.submit(join, r) for r in range(2)]

    def send(self, rank: int, tensors: list[torch.Tensor], *, digests: torch.Tensor | None = None) -> Status:
        group = self.trainers[rank]
        digest = digests_tensor(tensors, device=group.device) if digests is None else digests
        group.exchange(sends={ENGINE_RANK: [*tensors, digest]}, timeout_s=TIMEOUT_S)
        status = Status.empty(group.device)
        group.exchange(recvs={ENGINE_RANK: [status]}, timeout_s=TIMEOUT_S)
        return Status.from_tensor(status)

    def close(self) -> None:
        for group in self.trainers:
            group.destroy()
        self.pool.shutdown(wait=True)


@pytest.fixture
def channel():
    ch = Channel()
    yield ch
    ch.close()


def ticket_for(spec: ChannelSpec, names: dict[str, tuple[int, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    params = tuple(
        ParamTicket(name=n, source=s, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
        for n, (s, t) in names.items()
    )
    return [(TICKET_NAME, encode_ticket(Ticket(channel=spec, params=params)))]


def test_two_sources_land_in_the_models_own_tensors_checked_and_the_channel_is_reused(channel):
    model, receiver = Model(), Receiver()
    qkv_storage = model.qkv.weight.data.data_ptr()
    for round_index in range(2):
        values = sent_values(round_index)
        payload = ticket_for(channel.spec, {"qkv.weight": (0, values["qkv.weight"]), "norm": (1, values["norm"])})
        joined = channel.join_trainers() if round_index == 0 else []
        loading = channel.pool.submit(receiver.load, model, payload)
        if joined:
            channel.trainers = [f.result(timeout=TIMEOUT_S) for f in joined]
        statuses = [
            f.result(timeout=TIMEOUT_S)
            for f in [
                channel.pool.submit(channel.send, 0, [values["qkv.weight"]]),
                channel.pool.submit(channel.send, 1, [values["norm"]]),
            ]
        ]
        assert loading.result(timeout=TIMEOUT_S) == statuses == [Status(checked=1), Status(checked=1)]
        assert receiver.last_error is None
        assert torch.equal(model.qkv.weight.data, values["qkv.weight"]) and torch.equal(model.norm.data, values["norm"])
        assert model.qkv.weight.data.data_ptr() == qkv_storage  # received in place, no new tensor
    assert len(receiver.channels) == 1
    receiver.close()


def test_a_non_contiguous_parameter_is_received_into_a_buffer_and_copied_in(channel):
    model, receiver = StridedModel(), Receiver()
    value = torch.randn(4, 3)
    payload = ticket_for(channel.spec, {"weight": (0, value)})
    joined = channel.join_trainers()
    loading = channel.pool.submit(receiver.load, model, payload)
    channel.trainers = [f.result(timeout=TIMEOUT_S) for f in joined]
    status = channel.pool.submit(channel.send, 0, [value.contiguous()]).result(timeout=TIMEOUT_S)
    assert loading.result(timeout=TIMEOUT_S) == [status] == [Status(checked=1)]
    assert torch.equal(model.weight, value)
    receiver.close()


@pytest.mark.parametrize("fault", ["corrupted", "unknown name"])
def test_a_refused_parameter_is_named_by_its_index_and_the_channel_stays_usable(channel, fault):
    model, receiver = Model(), Receiver()
    values = sent_values(7)
    second = torch.randn(4, 3).to(torch.bfloat16)
    names = {"norm": (1, values["norm"]), "qkv.weight": (0, values["qkv.weight"])}
    if fault == "unknown name":
        names = {"norm": (1, values["norm"]), "no.such.weight": (0, values["qkv.weight"])}
    payload = ticket_for(channel.spec, names)
    joined = channel.join_trainers()
    loading = channel.pool.submit(receiver.load, model, payload)
    channel.trainers = [f.result(timeout=TIMEOUT_S) for f in joined]
    digests = digests_tensor([values["qkv.weight"]], device=torch.device("cpu"))
    sent = values["qkv.weight"].clone()
    if fault == "corrupted":
        sent.view(torch.uint8)[0] ^= 1  # one bit flipped after hashing: what a bad link does
    refused = channel.pool.submit(channel.send, 0, [sent], digests=digests)
    accepted = channel.pool.submit(channel.send, 1, [values["norm"]])
    expected = Refusal.DIGEST if fault == "corrupted" else Refusal.UNKNOWN
    assert refused.result(timeout=TIMEOUT_S) == Status(checked=0, refused_index=0, refusal=expected)
    assert accepted.result(timeout=TIMEOUT_S) == Status(checked=1)
    assert loading.result(timeout=TIMEOUT_S)[0].refusal is expected
    assert receiver.last_error is not None
    # The same channel carries the next ticket.
    payload = ticket_for(channel.spec, {"qkv.weight": (0, second)})
    loading = channel.pool.submit(receiver.load, model, payload)
    assert channel.send(0, [second]) == Status(checked=1)
    assert loading.result(timeout=TIMEOUT_S) == [Status(checked=1)] and receiver.last_error is None
    assert torch.equal(model.qkv.weight.data, second)
    receiver.close()


def test_an_engine_rank_keeps_one_channel_per_slot_and_a_slots_new_channel_replaces_its_old_one():
    """Two pipeline stages feed one engine rank over channels of their own (slot: each stage's source rank), turn
    about, round after round, without joining again; a new channel of slot 0 (a re-opened fleet) replaces slot 0's
    old one and leaves slot 2's."""
    stages = [Channel(), Channel()]
    for k, ch in enumerate(stages):
        ch.spec = dataclasses.replace(ch.spec, slot=2 * k)
    replacement = Channel()
    replacement.spec = dataclasses.replace(replacement.spec, slot=0)
    model, receiver = Model(), Receiver()
    try:
        for round_index in range(2):
            for k, ch in enumerate(stages):
                value = sent_values(10 * round_index + k)["norm"]
                joined = ch.join_trainers() if round_index == 0 else []
                loading = ch.pool.submit(receiver.load, model, ticket_for(ch.spec, {"norm": (0, value)}))
                if joined:
                    ch.trainers = [f.result(timeout=TIMEOUT_S) for f in joined]
                assert ch.send(0, [value]) == Status(checked=1)
                assert loading.result(timeout=TIMEOUT_S) == [Status(checked=1)]
                assert torch.equal(model.norm.data, value)
        assert set(receiver.channels) == {ch.spec.group_name for ch in stages}
        joined = replacement.join_trainers()
        loading = replacement.pool.submit(receiver.load, model, ticket_for(replacement.spec, {}))
        replacement.trainers = [f.result(timeout=TIMEOUT_S) for f in joined]
        assert loading.result(timeout=TIMEOUT_S) == []
        assert set(receiver.channels) == {stages[1].spec.group_name, replacement.spec.group_name}
    finally:
        receiver.close()
        for ch in (*stages, replacement):
            ch.close()


def test_a_source_that_never_sends_releases_the_loader_within_the_timeout_and_it_joins_again():
    store = start_store_server(host=HOST, timeout_s=TIMEOUT_S)
    spec = ChannelSpec(
        group_name=f"p2p-loader-test-{next(_GROUPS)}",
        master_address=HOST,
        master_port=store.port,
        world_size=2,
        rank=1,
        timeout_s=2.0,
    )
    model, receiver = Model(), Receiver()
    value = sent_values(3)["norm"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        joined = pool.submit(
            create_update_group,
            master_address=HOST,
            master_port=store.port,
            rank=0,
            world_size=2,
            group_name=spec.group_name,
            backend="gloo",
            timeout_s=TIMEOUT_S,
            store=store,
        )
        started = time.monotonic()
        payload = [(TICKET_NAME, encode_ticket(Ticket(channel=spec, params=(_norm_ticket(value),))))]
        assert receiver.load(model, payload) == []  # returns, raises nothing
        elapsed = time.monotonic() - started
        trainer = joined.result(timeout=TIMEOUT_S)
        trainer.destroy()
    assert elapsed < 2.0 + 5.0, elapsed
    assert "failed; dropped it" in receiver.last_error and spec.group_name in receiver.last_error
    assert receiver.channels == {}


def _norm_ticket(value: torch.Tensor) -> ParamTicket:
    return ParamTicket(name="norm", source=0, shape=tuple(value.shape), dtype="float32")


def test_a_close_ticket_destroys_the_channel(channel):
    receiver = Receiver()
    joined = channel.join_trainers()
    loading = channel.pool.submit(receiver.load, Model(), ticket_for(channel.spec, {}))
    channel.trainers = [f.result(timeout=TIMEOUT_S) for f in joined]
    assert loading.result(timeout=TIMEOUT_S) == []
    assert set(receiver.channels) == {channel.spec.group_name}
    receiver.load(Model(), [(TICKET_NAME, encode_ticket(Ticket(channel=channel.spec, close=True)))])
    assert receiver.channels == {} and receiver.last_error is None


def test_payloads_that_are_not_tickets_are_refused_without_raising():
    spec = ChannelSpec(group_name="g", master_address=HOST, master_port=1, world_size=2, rank=1)
    good = encode_ticket(Ticket(channel=spec, params=(_norm_ticket(torch.zeros(5)),)))
    assert decode_ticket([(TICKET_NAME, good)]).params[0].name == "norm"
    with pytest.raises(ValueError, match="exactly one tensor"):
        decode_ticket([("model.embed_tokens.weight", good)])
    with pytest.raises(ValueError, match="not a peer"):
        bad = Ticket(channel=spec, params=(ParamTicket(name="norm", source=1, shape=(5,), dtype="float32"),))
        decode_ticket([(TICKET_NAME, encode_ticket(bad))])
    with pytest.raises(ValueError, match="does not decode"):
        decode_ticket([(TICKET_NAME, torch.tensor(list(b"{not json"), dtype=torch.uint8))])
    receiver = Receiver()
    assert receiver.load(Model(), [("x", torch.zeros(3))]) == []
    assert "refused a payload" in receiver.last_error
    assert DIGEST_BYTES == 32
