"""The shard_direct delivery on the source alone (no group: the single-source feed plan): a fused parameter whose
parts arrive in different buckets is delivered once, whole, in the bucket that completes it; each engine rank's
payload decodes to exactly its own parameters as the engine stores them; a send that ends with a part missing is
refused naming the parameter; the next send starts clean."""

from __future__ import annotations

import pytest
import torch
from test_shard_plan import DENSE, SHAPE, tensors_of

from miles_sync.transport.fan_out import Collectives
from miles_sync.transport.feeds import FeedRole
from miles_sync.transport.shard_direct import DirectDelivery
from miles_sync.weights.engine_layout import rank_engine_tensors
from miles_sync.weights.layout import WeightLayout
from miles_sync.weights.shard_plan import DirectLayout
from miles_sync.wire.bucket import TensorMeta, pack_bucket
from miles_sync.wire.payload import decode_payload

pytestmark = pytest.mark.unit

LAYOUT = DirectLayout(shape=SHAPE, tp_size=2, weight_layout=WeightLayout.AITER)
QKV = "model.layers.0.self_attn.qkv_proj.weight"


class Alone(Collectives):
    """The source as the only member: nothing to move (what the fan-out's own solo group does)."""

    member = 0
    root = 0

    def broadcast_object(self, obj):
        return obj

    def broadcast_buffer(self, buffer):
        return None

    def all_gather_object(self, obj):
        return [obj]

    def send_buffers(self, buffers, *, to):
        raise AssertionError("nobody to send to")

    def recv_buffers(self, buffers, *, source):
        raise AssertionError("nobody to receive from")

    def destroy(self):
        return None


def delivery(tensors) -> DirectDelivery:
    metas = [TensorMeta(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in tensors.items()]
    role = FeedRole.single_source(tp_sizes=[2])
    return DirectDelivery(role=role, layouts=[LAYOUT], metas=metas, device=torch.device("cpu"))


def deliver(d: DirectDelivery, named) -> list[dict[str, torch.Tensor]]:
    """One bucket through the delivery: each engine rank's decoded payload ({} when it has nothing)."""
    contents, local = d.prepare(pack_bucket(named))
    local = d.receive(contents, local, Alone())
    payloads = d.encode(contents, local, feeds=[(0, 0), (0, 1)])
    return [{} if p is None else dict(decode_payload(p, load_format="direct")) for p in payloads]


def test_a_group_split_across_buckets_is_delivered_whole_once_it_completes():
    tensors = tensors_of(DENSE)
    prefix = "model.layers.0.self_attn."
    first = [(n, t) for n, t in tensors.items() if n.startswith(prefix + "q_proj")]
    rest = [(n, t) for n, t in tensors.items() if not n.startswith(prefix + "q_proj")]
    d = delivery(tensors)
    ranks = deliver(d, first)
    assert ranks == [{}, {}]  # q alone completes nothing
    later = deliver(d, rest)
    expected = [
        rank_engine_tensors(tensors, shape=SHAPE, tp_rank=r, tp_size=2, layout=LAYOUT.weight_layout) for r in (0, 1)
    ]
    for got, want in zip(later, expected):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)
    assert d.end_send() is None


def test_a_send_that_never_completes_a_group_is_refused_naming_it_and_the_next_starts_clean():
    tensors = tensors_of(DENSE)
    v = "model.layers.0.self_attn.v_proj.weight"
    d = delivery(tensors)
    deliver(d, [(n, t) for n, t in tensors.items() if n != v])
    problem = d.end_send()
    assert problem is not None and f"{QKV} (missing ['{v}'])" in problem, problem
    d.reset()
    deliver(d, list(tensors.items()))
    assert d.end_send() is None
