"""Pure parts of the sender side: unit/plan pairing, double buffers, bucket requests, group membership, checksum
comparison, and the Sender's pipelining through a registered in-process transport (the network is the only part
replaced: packing, planning and buffering are the real code)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from miles_sync.export.registry import ConversionMode
from miles_sync.export.units import ExportedUnit
from miles_sync.sync.buffers import DoubleBuffer
from miles_sync.sync.packing import pair_with_plans
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.sender import Sender, SenderSettings
from miles_sync.sync.verify import checksum_problems
from miles_sync.transport.base import (
    TRANSPORTS,
    RankForm,
    RankSetup,
    TransportError,
    TransportSpec,
    open_rank_transport,
    open_routed_rank,
    source_rank,
    transport_spec,
)
from miles_sync.transport.colocated import flattened_metadata
from miles_sync.transport.distributed import bucket_request
from miles_sync.transport.feeds import FeedRole
from miles_sync.transport.membership import EngineEndpoint, EngineRanks, GroupMembership, plan_membership
from miles_sync.weights.checksum import tensor_checksum
from miles_sync.wire.bucket import AtomicUnit, TensorMeta, layout_from_metadata, pack_bucket
from miles_sync.wire.protocol import LoadFormat, PauseMode, RankChecksums, Selector

# ---- units -----------------------------------------------------------------------------------------------------


def exported(key: str, *shapes_dtypes: tuple[tuple[int, ...], torch.dtype], seed: int = 0) -> ExportedUnit:
    generator = torch.Generator().manual_seed(seed)
    metas, tensors = [], []
    for i, (shape, dtype) in enumerate(shapes_dtypes):
        metas.append(TensorMeta(name=f"{key}.{i}", shape=shape, dtype=dtype))
        tensors.append((torch.randn(shape, generator=generator) * 4).to(dtype))
    return ExportedUnit(meta=AtomicUnit(key=key, tensors=tuple(metas)), tensors=tuple(tensors))


def model_units(num_units: int = 9) -> list[ExportedUnit]:
    """Mixed dtypes and odd shapes, 96..600 bytes per unit."""
    units = []
    for i in range(num_units):
        units.append(
            exported(
                f"layer{i}",
                ((3, 5 + i), torch.bfloat16),
                ((7,), torch.float32),
                ((2, 2, i + 1), torch.int8),
                seed=i,
            )
        )
    return units


def test_pairs_keep_every_unit_once_in_order():
    units = model_units()
    pairs = list(pair_with_plans(units, cap_bytes=200))
    flat = [u for _, taken in pairs for u in taken]
    assert [u.meta.key for u in flat] == [u.meta.key for u in units]
    assert all(a is b for a, b in zip(flat, units))
    for plan, taken in pairs:
        assert [u.meta for u in taken] == list(plan.units)
        assert plan.num_bytes <= 200 or len(taken) == 1  # an oversized unit travels alone
    assert [p.index for p, _ in pairs] == list(range(len(pairs)))


def test_pairing_holds_at_most_one_bucket_plus_one_unit():
    units = model_units()
    pulled = []

    def stream():
        for u in units:
            pulled.append(u.meta.key)
            yield u

    pairs = pair_with_plans(stream(), cap_bytes=300)
    first_plan, first_units = next(pairs)
    # The planner looked at exactly one unit past the first bucket to know that bucket was full.
    assert len(pulled) == len(first_units) + 1
    assert first_plan.num_bytes == sum(u.meta.num_bytes for u in first_units)


def test_double_buffer_alternates_and_reuses():
    buffers = DoubleBuffer(cap_bytes=64, device=torch.device("cpu"))
    b0, b1, b2, b3 = (buffers.for_bucket(i, 10) for i in range(4))
    assert b0.data_ptr() == b2.data_ptr() and b1.data_ptr() == b3.data_ptr()
    assert b0.data_ptr() != b1.data_ptr()
    # Sized to the bucket, not the cap: a model smaller than the cap never holds it.
    assert b0.numel() == 10 and b0.dtype == torch.uint8
    oversized = buffers.for_bucket(4, 100)
    assert oversized.numel() == 100 and oversized.data_ptr() not in (b0.data_ptr(), b1.data_ptr())
    assert buffers.for_bucket(6, 10).data_ptr() == b0.data_ptr()  # the oversized bucket did not replace the slot
    grown = buffers.for_bucket(8, 12)  # doubles (20 >= 12), bounded by the cap
    assert grown.numel() == 20
    assert buffers.for_bucket(10, 18).data_ptr() == grown.data_ptr()
    assert buffers.for_bucket(12, 50).numel() == 50  # max(50, 40)
    assert buffers.for_bucket(14, 60).numel() == 64  # 2 x 50 capped at 64
    assert buffers.for_bucket(16, 64).numel() == 64


def test_bucket_request_rebuilds_the_senders_offsets():
    named = [pair for u in model_units(3) for pair in u.named()]
    bucket = pack_bucket(named)
    request = bucket_request(bucket, selector=Selector.TARGET, group_name="g1")
    assert request.load_format is LoadFormat.FLATTENED_BUCKET
    assert request.selector is Selector.TARGET and request.group_name == "g1"
    assert request.flush_cache is False and request.weight_version is None
    rebuilt = layout_from_metadata(names=request.names, dtypes=request.dtypes, shapes=request.shapes)
    assert rebuilt == bucket.entries
    assert request.dtypes[0] == "float32"  # widest first: aligned without padding


def test_flattened_metadata_matches_the_buffer():
    named = [pair for u in model_units(2) for pair in u.named()]
    bucket = pack_bucket(named)
    records = flattened_metadata(bucket.entries)
    assert [(r.name, r.start_idx, r.end_idx, r.numel) for r in records] == [
        (e.name, e.start, e.end, e.end - e.start) for e in bucket.entries
    ]
    originals = dict(named)
    for r in records:
        view = bucket.buffer[r.start_idx : r.end_idx].view(r.dtype).view(r.shape)
        assert torch.equal(view.view(torch.uint8), originals[r.name].contiguous().view(torch.uint8))


# ---- membership ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp_sizes", "offsets", "world_size"),
    [
        ([1], [1], 2),
        ([1, 1], [1, 2], 3),
        ([2, 1, 4], [1, 3, 4], 8),
        ([8], [1], 9),
    ],
)
def test_membership_ranks(tp_sizes, offsets, world_size):
    engines = [EngineEndpoint(url=f"http://127.0.0.1:{9000 + i}", tp_size=tp) for i, tp in enumerate(tp_sizes)]
    membership = plan_membership(engines=engines, group_name="g", backend="gloo", master_address="127.0.0.1")
    assert membership.world_size == world_size and membership.source_rank == 0 and membership.master_port == 0
    assert [e.rank_offset for e in membership.engines] == offsets
    bound = membership.bound_to(address="127.0.0.1", port=29500)
    for engine, offset in zip(engines, offsets):
        request = bound.init_request(engine.url)
        assert (request.rank_offset, request.world_size, request.master_port) == (offset, world_size, 29500)
        assert (request.group_name, request.backend, request.master_address) == ("g", "gloo", "127.0.0.1")


def test_membership_validation_names_every_problem():
    engines = [
        EngineEndpoint(url="http://a", tp_size=1),
        EngineEndpoint(url="http://a", tp_size=0),
        EngineEndpoint(url="http://b", tp_size=-2),
    ]
    with pytest.raises(ValueError) as error:
        plan_membership(engines=engines, group_name="g", backend="gloo", master_address="127.0.0.1")
    message = str(error.value)
    assert "duplicate engine URLs ['http://a']" in message
    assert "http://a tp_size=0" in message and "http://b tp_size=-2" in message
    with pytest.raises(ValueError, match="at least one engine"):
        plan_membership(engines=[], group_name="g", backend="gloo", master_address="127.0.0.1")
    membership = GroupMembership(
        group_name="g",
        backend="gloo",
        master_address="127.0.0.1",
        master_port=1,
        world_size=2,
        engines=(EngineRanks(url="http://a", rank_offset=1, tp_size=1),),
    )
    with pytest.raises(ValueError, match="http://z is not a member of update group 'g'"):
        membership.init_request("http://z")


def test_transport_registry():
    assert transport_spec("distributed").needs_update_group and not transport_spec("colocated").needs_update_group
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'; registered: colocated, distributed"):
        transport_spec("carrier-pigeon")


def test_the_registry_row_decides_which_form_a_rank_runs():
    # Kills: the routed form chosen for bridge conversion (full HF tensors), or without a plan for shard_direct
    # (running servers: nothing ties an engine rank to a trainer rank), or p2p not spreading its own feeds.
    distributed, colocated, shard_direct, p2p = map(transport_spec, ("distributed", "colocated", "shard_direct", "p2p"))
    for spec in (distributed, colocated):
        assert spec.form(raw_conversion=True, has_feed_plan=True) is RankForm.GATHERED
    assert shard_direct.form(raw_conversion=True, has_feed_plan=True) is RankForm.ROUTED
    assert shard_direct.form(raw_conversion=True, has_feed_plan=False) is RankForm.GATHERED
    assert shard_direct.form(raw_conversion=False, has_feed_plan=True) is RankForm.GATHERED
    assert p2p.form(raw_conversion=True, has_feed_plan=False) is RankForm.SPREAD
    assert p2p.form(raw_conversion=True, has_feed_plan=True) is RankForm.ROUTED
    assert [name for name in TRANSPORTS if not transport_spec(name).can_pack_ahead()] == ["p2p"]
    assert p2p.engine_weight_loaders() == ("miles_sync.transport.p2p_loader.load_routed",)
    assert distributed.engine_weight_loaders() == ()


def test_the_registry_refuses_a_form_a_transport_does_not_have():
    setup = RankSetup(is_source=True, connect=lambda url: None)
    engines = [EngineEndpoint(url="http://127.0.0.1:1", tp_size=1)]
    assert transport_spec("p2p").rank_factory is None  # p2p only sends each rank's own shards
    with pytest.raises(ValueError, match=r"the p2p transport .* needs raw conversion \(sync.conversion=raw\)"):
        asyncio.run(open_rank_transport("p2p", engines=engines, setup=setup))
    with pytest.raises(ValueError, match="the distributed transport has no routed form"):
        asyncio.run(open_routed_rank("distributed", engines=engines, setup=setup, bucket_bytes=1, holdings=()))


# ---- verification ----------------------------------------------------------------------------------------------


def rank(checksums: dict[str, str]) -> RankChecksums:
    return RankChecksums(checksums=checksums, per_gpu_checksum="x", parallelism_info=())


SENT = {"embed": "e1", "layers.0.q": "q1", "mtp.eh_proj": "m1"}


@pytest.mark.parametrize(
    ("selector", "held", "sent", "problems", "num_verified"),
    [
        (Selector.TARGET, {"embed": "e1", "layers.0.q": "q1"}, {"embed": "e1", "layers.0.q": "q1"}, [], 2),
        # the draft's report is ignored when the selector does not cover it
        (Selector.TARGET, {"embed": "e1", "draft.mtp.eh_proj": "OLD"}, {"embed": "e1"}, [], 1),
        # draft names carry the prefix on the engine, not on the trainer
        (Selector.ALL, {"embed": "e1", "layers.0.q": "q1", "draft.mtp.eh_proj": "m1"}, SENT, [], 3),
        (
            Selector.ALL,
            {"embed": "e1", "layers.0.q": "BAD", "draft.mtp.eh_proj": "m1"},
            SENT,
            ["differs layers.0.q: expected q1, got BAD"],
            2,
        ),
        (
            Selector.TARGET,
            {"embed": "e1", "layers.0.q": "q1", "layers.0.k": "k0"},
            {"embed": "e1", "layers.0.q": "q1"},
            ["extra layers.0.k: reported k0, not expected"],
            2,
        ),
        (
            Selector.TARGET,
            {"embed": "e1", "layers.0.q": "q1"},
            SENT,
            ["sent mtp.eh_proj: no runner covered by selector 'target' holds it"],
            2,
        ),
    ],
)
def test_checksum_problems(selector, held, sent, problems, num_verified):
    assert checksum_problems(sent=sent, ranks=[rank(held)], selector=selector) == (problems, num_verified)


def test_checksum_problems_per_rank_and_empty_report():
    found, num_verified = checksum_problems(
        sent={"a": "1"}, ranks=[rank({"a": "1"}), rank({"a": "2"})], selector=Selector.TARGET
    )
    assert found == ["rank 1: differs a: expected 1, got 2"] and num_verified == 1
    empty = checksum_problems(sent={"a": "1"}, ranks=[], selector=Selector.ALL)
    assert empty[0][0] == "the engine reported no checksums"


# ---- the sender's pipeline through an in-process transport -----------------------------------------------------


PACKED_AHEAD_S = 30.0  # a bound, not a window: a sender that packs ahead signals within milliseconds


class RecordingTransport:
    """Registered under a test name: records each bucket and checks its buffer is untouched while in flight.

    Each of the first `held_buckets` buckets (class-wide; 0: none) waits in flight until the test signals that
    the next bucket has been packed, which only a sender that packs ahead can do (`overlapped` records whether the
    signal came within PACKED_AHEAD_S); `fail_at` fails one bucket.
    """

    name = "recording"
    instances: list[RecordingTransport] = []
    held_buckets = 0

    def __init__(self, *, engines, fail_at: int | None = None) -> None:
        self.engines = engines
        self.fail_at = fail_at
        self.received: list[dict[str, torch.Tensor]] = []
        self.buffer_ptrs: list[int] = []
        self.overlapped: list[bool] = []
        self.packed_ahead = threading.Event()
        RecordingTransport.instances.append(self)

    async def open(self, *, membership, timeout_s):
        return membership

    async def send_bucket(self, bucket, *, selector, timeout_s):
        index = len(self.received)
        before = bucket.buffer.clone()
        self.buffer_ptrs.append(bucket.buffer.data_ptr())
        self.received.append(
            {e.name: bucket.buffer[e.start : e.end].clone().view(e.dtype).view(e.shape) for e in bucket.entries}
        )
        if index == self.fail_at:
            raise TransportError(f"bucket {index} refused")
        if index < self.held_buckets:  # stay in flight until the next bucket is packed
            self.overlapped.append(await asyncio.to_thread(self.packed_ahead.wait, PACKED_AHEAD_S))
            self.packed_ahead.clear()
        assert torch.equal(before, bucket.buffer), f"bucket {index} was overwritten while in flight"

    async def close(self, *, timeout_s):
        return None


@pytest.fixture
def recording(monkeypatch):
    RecordingTransport.instances.clear()
    monkeypatch.setattr(RecordingTransport, "held_buckets", 0)
    monkeypatch.setitem(
        TRANSPORTS,
        "recording",
        TransportSpec(module=__name__, rank_factory="open_recording_rank", needs_update_group=False, endpoints=()),
    )
    return RecordingTransport


def make_sender(units, *, transport="recording", bucket_bytes=400, on_pull=None, hash_buckets=True) -> Sender:
    def export():
        for u in units:
            if on_pull is not None:
                on_pull(u)
            yield u

    settings = SenderSettings(
        transport="distributed" if transport is None else transport,  # None: a rank that is not the source
        bucket_bytes=bucket_bytes,
        bucket_timeout_s=5.0,
        open_timeout_s=5.0,
        http_timeout_s=5.0,
        call_timeout_s=5.0,
        hash_buckets=hash_buckets,
    )
    names = [m.name for u in units for m in u.meta.tensors]
    return Sender(settings=settings, export=export, names=lambda: names, is_source=transport is not None)


ENGINES = [EngineEndpoint(url="http://127.0.0.1:1", tp_size=1)]


def test_sender_packs_ahead_and_reports_exact_checksums(recording):
    units = model_units()
    plans = list(pair_with_plans(units, cap_bytes=160))
    first_unit_of_bucket = {taken[0].meta.key: plan.index for plan, taken in plans}

    def on_pull(unit):
        # Pulling the first unit of bucket i+2 means bucket i+1 is complete and about to be packed.
        index = first_unit_of_bucket.get(unit.meta.key)
        if index is not None and index >= 2 and recording.instances:
            recording.instances[0].packed_ahead.set()

    # Bucket i's signal comes when bucket i+2's first unit is pulled: the last two buckets have none to wait for.
    recording.held_buckets = len(plans) - 2
    sender = make_sender(units, on_pull=on_pull, bucket_bytes=160)
    progress = []

    async def main():
        await sender.open(engines=ENGINES, membership=None)
        result = await sender.send(selector=Selector.TARGET, on_bucket=progress.append)
        await sender.close()
        return result

    result = asyncio.run(main())
    transport = recording.instances[0]
    assert result.num_buckets == len(plans) >= 4
    assert transport.overlapped == [True] * (len(plans) - 2), transport.overlapped
    # Two buffers, alternating: even and odd buckets never share one; each slot grows at most once here (the
    # buckets are within 2x of each other), so it is reused from then on.
    even, odd = set(transport.buffer_ptrs[0::2]), set(transport.buffer_ptrs[1::2])
    assert not even & odd and len(even) <= 2 and len(odd) <= 2, transport.buffer_ptrs
    assert len(transport.buffer_ptrs) - len(even | odd) >= len(plans) - 4
    # Every tensor arrived bit-exact, and its reported checksum is that of the original tensor.
    originals = {name: t for u in units for name, t in u.named()}
    arrived = {name: t for bucket in transport.received for name, t in bucket.items()}
    assert arrived.keys() == originals.keys()
    for name, tensor in originals.items():
        assert torch.equal(arrived[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
    assert result.checksums == {name: tensor_checksum(t) for name, t in originals.items()}
    assert result.num_tensors == len(originals)
    assert result.num_bytes == sum(u.meta.num_bytes for u in units)
    assert [p.index for p in progress] == list(range(len(plans)))
    assert progress[-1].total_bytes == result.num_bytes


@pytest.mark.parametrize("hash_buckets", [True, False])
def test_staged_and_live_sends_deliver_the_same_bytes_and_counts(recording, hash_buckets):
    units = model_units()
    originals = {name: t for u in units for name, t in u.named()}
    sender = make_sender(units, bucket_bytes=160, hash_buckets=hash_buckets)

    async def main():
        await sender.open(engines=ENGINES, membership=None)
        live = await sender.send(selector=Selector.TARGET)
        staged_result = await sender.stage()
        staged = await sender.send(selector=Selector.TARGET)
        await sender.close()
        return live, staged_result, staged

    live, stage_result, staged = asyncio.run(main())
    assert stage_result.num_buckets == staged.num_buckets == live.num_buckets >= 4
    for result in (live, staged):
        assert result.num_tensors == len(originals)
        assert result.num_bytes == sum(u.meta.num_bytes for u in units)
        # With hashing off nothing is claimed: the session then has no checksums to compare (see Sender's docstring).
        expected = {name: tensor_checksum(t) for name, t in originals.items()} if hash_buckets else {}
        assert result.checksums == expected
    received = recording.instances[0].received
    assert len(received) == 2 * live.num_buckets
    for bucket_live, bucket_staged in zip(received[: live.num_buckets], received[live.num_buckets :], strict=True):
        assert bucket_live.keys() == bucket_staged.keys()
        for name in bucket_live:
            assert torch.equal(bucket_live[name].view(torch.uint8), bucket_staged[name].view(torch.uint8)), name
            assert torch.equal(bucket_live[name].view(torch.uint8), originals[name].contiguous().view(torch.uint8))


def test_sender_drains_the_stream_after_a_failed_bucket(recording, monkeypatch):
    units = model_units()
    pulled = []
    sender = make_sender(units, on_pull=lambda u: pulled.append(u.meta.key))
    monkeypatch.setitem(
        TRANSPORTS,
        "recording",
        TransportSpec(module=__name__, rank_factory="open_failing_rank", needs_update_group=False, endpoints=()),
    )

    async def main():
        await sender.open(engines=ENGINES, membership=None)
        with pytest.raises(TransportError, match="bucket 1 refused"):
            await sender.send(selector=Selector.ALL)

    asyncio.run(main())
    # Other trainer ranks run the export's collectives to the end: the source consumes the whole stream too.
    assert pulled == [u.meta.key for u in units]
    assert len(recording.instances[0].received) == 2


class FailingAtOne(RecordingTransport):
    def __init__(self, *, engines) -> None:
        super().__init__(engines=engines, fail_at=1)


async def open_recording_rank(*, engines, setup):
    return source_rank(RecordingTransport, engines=engines, setup=setup)


async def open_failing_rank(*, engines, setup):
    return source_rank(FailingAtOne, engines=engines, setup=setup)


def test_sender_refuses_a_repeated_tensor_before_sending_it(recording):
    units = model_units(3)
    units.append(units[1])
    sender = make_sender(units, bucket_bytes=1)  # one unit per bucket: the repeat is in a bucket of its own

    async def main():
        await sender.open(engines=ENGINES, membership=None)
        with pytest.raises(ValueError, match=r"yielded tensor\(s\) \['layer1.0', 'layer1.1', 'layer1.2'\] more than"):
            await sender.send(selector=Selector.ALL)

    asyncio.run(main())
    sent = [list(b) for b in recording.instances[0].received]
    assert sent == [[f"layer{i}.{j}" for j in (1, 0, 2)] for i in range(3)]


def test_non_source_rank_only_consumes_the_stream():
    units = model_units(4)
    pulled = []
    sender = make_sender(units, transport=None, on_pull=lambda u: pulled.append(u.meta.key))

    async def main():
        assert await sender.open(engines=ENGINES, membership=None) is None
        return await sender.send(selector=Selector.ALL)

    result = asyncio.run(main())
    assert pulled == [u.meta.key for u in units]
    assert (result.num_buckets, result.num_bytes, result.checksums) == (0, 0, {})


def test_sender_validates_its_arguments():
    with pytest.raises(ValueError) as error:
        Sender(
            settings=SenderSettings(
                transport="pigeon",
                bucket_bytes=0,
                bucket_timeout_s=0,
                open_timeout_s=1,
                http_timeout_s=-1,
                call_timeout_s=1,
            ),
            export=list,
            names=list,
        )
    message = str(error.value)
    for part in ("transport='pigeon'", "bucket_bytes=0", "bucket_timeout_s=0", "http_timeout_s=-1"):
        assert part in message


def test_sender_refuses_a_feed_role_that_disagrees_with_its_source_side():
    role = FeedRole.single_source(tp_sizes=[1])  # rank 0, the source
    settings = SenderSettings(
        transport="colocated", bucket_bytes=1, bucket_timeout_s=1, open_timeout_s=1, http_timeout_s=1, call_timeout_s=1
    )
    with pytest.raises(ValueError, match="needs a transport exactly on the source"):
        Sender(settings=settings, export=list, names=list, is_source=False, feeds=role)
    assert Sender(settings=settings, export=list, names=list, is_source=True, feeds=role).is_source


def test_a_source_declares_its_surface_and_inherits_the_defaults():
    """Nothing probes a source: what it cannot do is declared (can_stage, syncs_adapters), the defaults refuse by
    name, and the controller refuses a configuration the source cannot serve before anything runs."""
    from miles_sync.sync.controller import SyncController
    from miles_sync.sync.session import SelectorInputs, SessionTimeouts
    from miles_sync.sync.weight_source import WeightSource

    class Minimal(WeightSource):
        async def exported_names(self):
            return ()

    source = Minimal()
    assert not source.can_stage and not source.syncs_adapters
    assert source.num_stages == 1 and source.memberships == () and asyncio.run(source.connect()) == ()
    with pytest.raises(NotImplementedError, match="Minimal cannot pack ahead"):
        asyncio.run(source.stage())
    with pytest.raises(NotImplementedError, match="Minimal syncs no LoRA adapters"):
        asyncio.run(source.adapter_payload(tp_sizes=[1]))
    assert Sender.can_stage
    inputs = SelectorInputs(
        mode=SelectorMode.AUTO, speculative_algorithm=None, num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
    )
    common = dict(
        engine_urls=["http://127.0.0.1:1"],
        source=source,
        transport="distributed",
        selector_inputs=inputs,
        pause_mode=PauseMode.ABORT,
        verify=True,
        timeouts=SessionTimeouts(control_s=1.0, sync_s=1.0),
    )
    with pytest.raises(ValueError, match="staged export needs a source that can stage; Minimal cannot"):
        SyncController(**common, staged=True)
    with pytest.raises(ValueError, match="LoRA syncs need a source that answers adapters; Minimal does not"):
        SyncController(**common, lora_name="policy")
    # A source that flushes the prefix cache with its updates cannot serve in_place pauses (SGLang refuses the
    # flush while requests run, failing every update); with the default it can.
    assert not source.flushes_cache
    SyncController(**{**common, "pause_mode": PauseMode.IN_PLACE})
    source.flushes_cache = True
    with pytest.raises(ValueError, match="pause_mode=in_place keeps requests running"):
        SyncController(**{**common, "pause_mode": PauseMode.IN_PLACE})
    SyncController(**{**common, "pause_mode": PauseMode.RETRACT})


def test_a_send_without_a_plan_predicts_nothing(recording):
    sender = make_sender(model_units(3))

    async def main():
        await sender.open(engines=ENGINES, membership=None)
        return await sender.send(selector=Selector.ALL)

    assert asyncio.run(main()).engine_checksums == {}
