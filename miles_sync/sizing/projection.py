"""Projected sync time, pause window and peak extra memory of one sync, per transport, from costs and a layout.

Notation: S bytes exported (all stages), T tensors, K buckets (ceil of each stage's bytes over the bucket size), E
engines of `engine_tp` ranks each (R = E x engine_tp receiving ranks), m / h the memcpy / hash rates, B the link.

Per stage source (stages export concurrently):
  gather   = TP-sharded bytes x (tp-1)/tp / B_gather + expert bytes x (1 - 1/(ep x etp)) / B_gather
             (B_gather = the intra-node link when a stage's model-parallel ranks, max(tp, ep x etp), fit in a node,
             else the inter-node link)
  source   = gather + S_stage / m (pack); the sender's digests (S_stage / h, when verifying) run on a thread of
             their own while the bucket is on the wire
Transports:
  broadcast (one source): stages 1.. ship their bytes to stage 0's source first (the PP hop, over the inter-node
             link when the stages span nodes), then one source broadcasts everything:
             link = sum over buckets of t_bcast(bucket, R)   (miles_sync.sizing.collective)
  per_stage (one source per stage): no PP hop; each stage source broadcasts its own share over its own group. An
             engine takes one update group at a time (SGLang and miles_sync.sync.pipeline), so the stages' transfers
             follow one another; their exports and packing run concurrently, a later stage packing ahead and holding
             its packed share until its turn: done_s = max(done_{s-1}, source_s + digests_s) + link_s + load_s.
  colocated (per node): each node's trainer ranks hand their engines IPC handles (CUDA IPC; shared memory here),
             no broadcast; a node first receives the bytes its own trainer ranks do not hold (stages on other nodes)
             over the inter-node link; so with the model-parallel group inside a node it does not depend on B.
  load     = S / engine_tp / load per engine rank (its shard out of each received bucket; `load` is fitted)
  send     = pipeline(source, max(link + load, digests), K) + K x per_bucket + T x per_tensor, where
             pipeline(A, L, K) = (A + L) / K + (K-1)/K x (max(A, L) + overlap x min(A, L))
             (double buffering: the source packs bucket i+1 while bucket i is on the wire and being loaded)
  verify   = S / engine_tp / h (each engine rank hashes its weights), when verifying
  sync     = per_sync + per_engine x E + send + verify; the pause window is all of it.
  p2p (shard-owned, engines anywhere; miles_sync.transport.p2p): no gather and no broadcast. Each engine rank
             receives its own shard, S / engine_tp; the R engine ranks are fed round robin by the N = stage_width x
             pp ranks of one trainer replica, so the busiest trainer rank builds and sends ceil(R / N) shards; a
             feeder holds f = min(1, engine_tp / stage_width) of each shard it feeds and takes the rest from its
             peers first (S / engine_tp x (1 - f) per shard, within the node when a replica fits one). Every slice is
             hashed where it is built and again where it lands (the per-slice digests), and it lands in place (no
             load step): send = exchange + busiest x (1 / m + 1 / h) + max(busiest, S / engine_tp) / B +
             S / engine_tp / h + the per-call costs (+ S / engine_tp / h when verifying); no staging.
Staged (`staged=True`): export, gather, packing (into freshly allocated memory, at the `fresh_copy` rate: every
packed bucket is kept, so no buffer is reused) and the sender's digests run before the pause (stage_s = source
time of the largest stage, or of the one source), so the pause window holds only link + load, the per-call costs
and the engines' verification, and the sender holds every packed byte of its stage(s) until the send.
Shared cores (`shared_cores`, the fit machine's case): processes compete for cores, so every engine-side term is
scaled by max(1, R / cores) and the send is at least all CPU work (pack, hash, loads) over the cores.
Peak extra memory: sender 2 buckets (double buffer) or, staged, its packed stage; each engine rank one bucket
(its receive buffer) for broadcasts, none for colocated (it maps the sender's buffer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from miles_sync.sizing.collective import BroadcastAlgorithm, broadcast_seconds
from miles_sync.sizing.costs import Costs
from miles_sync.sizing.shapes import ExportDtype, ModelShape

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sizing


class Transport(str, Enum):
    BROADCAST = "broadcast"  # one source, every stage gathered to it
    PER_STAGE = "per_stage"  # one source per pipeline stage, concurrent exports
    COLOCATED = "colocated"  # per node, IPC handles, no broadcast
    P2P = "p2p"  # every trainer rank sends its own shards point to point to the engine ranks that keep them


@dataclass(frozen=True, kw_only=True)
class TrainerLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallelism (Megatron's expert_tensor_parallel_size)

    def __post_init__(self) -> None:
        bad = [f"{k}={getattr(self, k)}" for k in ("tp", "pp", "ep", "etp") if getattr(self, k) < 1]
        if bad:
            raise ValueError(f"trainer layout sizes must be >= 1: {', '.join(bad)}")

    @property
    def stage_width(self) -> int:
        """Ranks one stage's model-parallel group spans (one data-parallel replica's worth)."""
        return max(self.tp, self.ep * self.etp)


@dataclass(frozen=True, kw_only=True)
class EngineFleet:
    """The engines a sync reaches: how many, each at which TP size (not miles_sync.sync.engine_digests.EngineLayout,
    an engine's parameter layout)."""

    count: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or self.tp < 1:
            raise ValueError(f"engine layout needs count >= 1 and tp >= 1, got count={self.count} tp={self.tp}")

    @property
    def num_ranks(self) -> int:
        return self.count * self.tp


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """`link_gbps`: one rank's inter-node link (GB/s); `intra_gbps`: within a node (NVLink); `gpus_per_node`."""

    link_gbps: float
    intra_gbps: float | None = None  # None: the same as link_gbps
    gpus_per_node: int = 8
    shared_cores: int | None = None  # every process shares this many cores (the fit machine); None on a cluster
    shares_nic: bool = True  # a source's concurrent sends share one NIC; False on loopback (collective.py)
    latency_s: float | None = None  # per message and hop; None: the one fitted with the costs

    def __post_init__(self) -> None:
        if not self.link_gbps > 0 or (self.intra_gbps is not None and not self.intra_gbps > 0):
            raise ValueError(f"link bandwidths must be > 0, got link={self.link_gbps} intra={self.intra_gbps}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    @property
    def intra(self) -> float:
        return self.link_gbps if self.intra_gbps is None else self.intra_gbps


@dataclass(frozen=True, kw_only=True)
class Projection:
    transport: Transport
    sync_s: float
    pause_s: float
    stage_s: float  # before the pause (staged); 0 otherwise
    sender_extra_bytes: int
    engine_rank_extra_bytes: int
    num_bytes: int
    num_tensors: int
    num_buckets: int
    terms: dict[str, float]  # seconds per term, summed over stages where they follow one another

    @property
    def pause_fraction(self) -> float:
        return self.pause_s / self.sync_s if self.sync_s > 0 else 0.0


def stage_of_layer(layer: int, *, num_layers: int, pp: int) -> int:
    """Megatron's even split: the embedding (layer -1) on the first stage, the head and MTP on the last."""
    if layer < 0:
        return 0
    if layer >= num_layers:
        return pp - 1
    return min(pp - 1, layer * pp // num_layers)


@dataclass(frozen=True)
class _Stage:
    num_bytes: int
    num_tensors: int
    tp_bytes: int  # TP-sharded, not expert
    expert_bytes: int


def _stages(shape: ModelShape, *, dtype: ExportDtype, pp: int) -> list[_Stage]:
    acc = [[0, 0, 0, 0] for _ in range(pp)]
    for g in shape.groups:
        s = acc[stage_of_layer(g.layer, num_layers=shape.num_layers, pp=pp)]
        n = g.num_bytes(dtype)
        s[0] += n
        s[1] += g.num_tensors(dtype)
        s[2] += n if g.is_tp_sharded and not g.is_expert else 0
        s[3] += n if g.is_expert else 0
    return [_Stage(*a) for a in acc]


def _pipeline(source_s: float, sink_s: float, *, num_buckets: int, overlap: float) -> float:
    k = max(1, num_buckets)
    return (source_s + sink_s) / k + (k - 1) / k * (max(source_s, sink_s) + overlap * min(source_s, sink_s))


def project(
    shape: ModelShape,
    *,
    transport: Transport,
    trainer: TrainerLayout,
    engines: EngineFleet,
    cluster: Cluster,
    costs: Costs,
    dtype: ExportDtype = ExportDtype.BF16,
    bucket_bytes: int = 1 << 30,
    verify: bool = True,
    staged: bool = False,
    algorithm: BroadcastAlgorithm | None = None,
) -> Projection:
    """One sync of `shape` under `transport`, broadcasting with `algorithm` (default: the one `costs` were fitted
    with). Pure; see the module docstring for every term."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if transport is Transport.P2P:
        if staged:
            raise ValueError("p2p sends each rank's own shards at send time: it has no staged form")
        layout = dict(trainer=trainer, engines=engines, cluster=cluster)
        return _project_p2p(shape, **layout, costs=costs, dtype=dtype, bucket_bytes=bucket_bytes, verify=verify)
    sync = _Sync(
        transport=transport,
        trainer=trainer,
        engines=engines,
        cluster=cluster,
        costs=costs,
        verify=verify,
        staged=staged,
        algorithm=algorithm,
    )
    stages = _stages(shape, dtype=dtype, pp=trainer.pp)
    total = sum(s.num_bytes for s in stages)
    sources, hop = _sources(sync, stages, total=total)
    sent = _send(sync, sources, hop=hop, bucket_bytes=bucket_bytes)
    terms = sent.terms
    verify_s = total / engines.tp / sync.hasher * sync.contention if verify else 0.0
    fixed = costs.per_sync_s + costs.per_engine_s * engines.count
    terms["verify"] = verify_s
    terms["per_call"] += fixed
    pause = fixed + sent.send_s + verify_s
    bucket = min(bucket_bytes, max(s.num_bytes for s in stages))
    return Projection(
        transport=transport,
        sync_s=sent.stage_s + pause,
        pause_s=pause,
        stage_s=sent.stage_s,
        sender_extra_bytes=_sender_extra_bytes(stages, transport=transport, total=total, bucket=bucket, staged=staged),
        engine_rank_extra_bytes=0 if transport is Transport.COLOCATED else bucket,
        num_bytes=total,
        num_tensors=shape.num_tensors(dtype),
        num_buckets=sent.num_buckets,
        terms=terms,
    )


@dataclass(frozen=True, kw_only=True)
class _Sync:
    """A broadcast, per-stage or colocated sync's inputs, and its per-byte terms (the module docstring's)."""

    transport: Transport
    trainer: TrainerLayout
    engines: EngineFleet
    cluster: Cluster
    costs: Costs
    verify: bool
    staged: bool
    algorithm: BroadcastAlgorithm | None

    @property
    def memcpy(self) -> float:
        return self.costs.memcpy_gbps * 1e9

    @property
    def hasher(self) -> float:
        return self.costs.hash_gbps * 1e9

    @property
    def fresh(self) -> float:
        return self.costs.fresh_copy_gbps * 1e9

    @property
    def contention(self) -> float:
        """Processes sharing cores (the fit machine): engine-side work queues behind the other ranks'."""
        shared_cores = self.cluster.shared_cores
        return 1.0 if shared_cores is None else max(1.0, self.engines.num_ranks / shared_cores)

    def gather_s(self, stage: _Stage) -> float:
        trainer, cluster = self.trainer, self.cluster
        fits_node = trainer.stage_width <= cluster.gpus_per_node
        gather_bw = (cluster.intra if fits_node else cluster.link_gbps) * 1e9
        tp_part = stage.tp_bytes * (trainer.tp - 1) / trainer.tp
        ep_part = stage.expert_bytes * (1 - 1 / (trainer.ep * trainer.etp))
        return (tp_part + ep_part) / gather_bw

    def prep_s(self, num_bytes: int) -> float:
        """The source's packing; a staged one packs into fresh memory and hashes."""
        if self.staged:
            return num_bytes / self.fresh + (num_bytes / self.hasher if self.verify else 0.0)
        return num_bytes / self.memcpy

    def load_s(self, num_bytes: int) -> float:
        # Seconds per byte sent, per engine rank (the ranks load in parallel).
        load_one = 1.0 / self.engines.tp / (self.costs.load_gbps * 1e9) * self.contention
        return num_bytes * load_one

    def link_s(self, num_bytes: int, num_buckets: int) -> float:
        if self.transport is Transport.COLOCATED:
            return 0.0
        costs, cluster = self.costs, self.cluster
        bucket = num_bytes / max(1, num_buckets)
        one = broadcast_seconds(
            bucket,
            num_receivers=self.engines.num_ranks,
            link_gbps=cluster.link_gbps,
            algorithm=costs.algorithm if self.algorithm is None else self.algorithm,
            latency_s=costs.link_latency_s if cluster.latency_s is None else cluster.latency_s,
            shares_nic=cluster.shares_nic,
        )
        return one * num_buckets


@dataclass(frozen=True)
class _Source:
    """One source of a sync: the bytes and tensors it sends, and its seconds before the first byte leaves."""

    num_bytes: int
    num_tensors: int
    gather_s: float


def _sources(sync: _Sync, stages: list[_Stage], *, total: int) -> tuple[list[_Source], float]:
    """The transport's sources, and the PP hop's seconds (0 per stage: each stage is its own source)."""
    trainer, cluster = sync.trainer, sync.cluster
    if sync.transport is Transport.PER_STAGE:
        return [_Source(s.num_bytes, s.num_tensors, sync.gather_s(s)) for s in stages], 0.0
    stages_share_node = trainer.stage_width * trainer.pp <= cluster.gpus_per_node
    hop_bw = (cluster.intra if stages_share_node else cluster.link_gbps) * 1e9
    hop_bytes = sum(s.num_bytes for s in stages[1:])
    if sync.transport is Transport.COLOCATED:
        # A node lacks the stages on other nodes: 1 - 1/(nodes one replica spans) of the bytes.
        nodes = max(1, math.ceil(trainer.stage_width * trainer.pp / cluster.gpus_per_node))
        hop_bytes = int(total * (1 - 1 / nodes))
        hop_bw = cluster.link_gbps * 1e9 if nodes > 1 else hop_bw
    hop = hop_bytes / hop_bw
    num_tensors = sum(s.num_tensors for s in stages)
    return [_Source(total, num_tensors, max(sync.gather_s(s) for s in stages) + hop)], hop


@dataclass(frozen=True)
class _Sent:
    send_s: float  # when the last source's last bucket is loaded, from the first export
    stage_s: float  # before the pause (staged); 0 otherwise
    num_buckets: int
    terms: dict[str, float]  # every term but the engines' verification and the per-sync costs


def _send(sync: _Sync, sources: list[_Source], *, hop: float, bucket_bytes: int) -> _Sent:
    """The sources' sends, one after another (the module docstring's send and per_stage rules)."""
    costs, cluster = sync.costs, sync.cluster
    terms = dict.fromkeys(("gather", "pp_hop", "pack", "hash", "link", "load", "verify", "per_call"), 0.0)
    terms["pp_hop"] = hop
    send = stage_total = 0.0
    num_buckets = 0
    for index, source in enumerate(sources):
        num_bytes = source.num_bytes
        k = max(1, math.ceil(num_bytes / bucket_bytes))
        num_buckets += k
        ready = source.gather_s + sync.prep_s(num_bytes)
        link = sync.link_s(num_bytes, k)
        load = sync.load_s(num_bytes)
        # The sender's digests run on a thread of their own, while the bucket is sent.
        digests = num_bytes / sync.hasher if sync.verify and not sync.staged else 0.0
        sink = max(link + load, digests)
        calls = k * costs.per_bucket_s + source.num_tensors * costs.per_tensor_s
        if sync.staged:
            stage_total = max(stage_total, ready)  # stages pack concurrently, before the pause
            send += sink + calls
        elif index > 0:  # a later stage packed ahead while the earlier ones sent; its turn is send + load only
            send = max(send, ready + digests) + link + load + calls
        else:
            send = _pipeline(ready, sink, num_buckets=k, overlap=costs.overlap) + calls
            if cluster.shared_cores is not None:  # all CPU work over the cores bounds it from below
                loads = num_bytes / (costs.load_gbps * 1e9) * sync.engines.num_ranks / sync.engines.tp
                cpu = sync.prep_s(num_bytes) + digests + loads
                send = max(send, cpu / cluster.shared_cores + calls)
        terms["gather"] += source.gather_s - (hop if sync.transport is not Transport.PER_STAGE else 0.0)
        terms["pack"] += num_bytes / (sync.fresh if sync.staged else sync.memcpy)
        terms["hash"] += num_bytes / sync.hasher if sync.verify else 0.0
        terms["link"] += link
        terms["load"] += load
        terms["per_call"] += calls
    return _Sent(send_s=send, stage_s=stage_total, num_buckets=num_buckets, terms=terms)


def _sender_extra_bytes(stages: list[_Stage], *, transport: Transport, total: int, bucket: int, staged: bool) -> int:
    """Sender 2 buckets (double buffer) or, staged, its packed stage(s); per stage, a later stage holds its packed
    share until its turn."""
    if staged:
        return total if transport is not Transport.PER_STAGE else max(s.num_bytes for s in stages)
    if transport is Transport.PER_STAGE and len(stages) > 1:
        return max(2 * bucket, max(s.num_bytes for s in stages[1:]))
    return 2 * bucket


def _project_p2p(
    shape: ModelShape,
    *,
    trainer: TrainerLayout,
    engines: EngineFleet,
    cluster: Cluster,
    costs: Costs,
    dtype: ExportDtype,
    bucket_bytes: int,
    verify: bool,
) -> Projection:
    """The p2p transport's sync (module docstring). Its per-slice digests are always on; `verify` adds the engines'
    own check after the session (the engine-exact digests)."""
    total = shape.num_bytes(dtype)
    num_tensors = shape.num_tensors(dtype)
    memcpy, hasher, link = costs.memcpy_gbps * 1e9, costs.hash_gbps * 1e9, cluster.link_gbps * 1e9
    shard = total / engines.tp
    feeders = trainer.stage_width * trainer.pp
    busiest = math.ceil(engines.num_ranks / feeders) * shard
    held = min(1.0, engines.tp / trainer.stage_width)
    fits_node = trainer.stage_width * trainer.pp <= cluster.gpus_per_node
    exchange_bw = (cluster.intra if fits_node else cluster.link_gbps) * 1e9
    num_buckets = max(1, math.ceil(shard / bucket_bytes))
    terms = dict.fromkeys(("gather", "pp_hop", "pack", "hash", "link", "load", "verify", "per_call"), 0.0)
    terms["gather"] = busiest * (1 - held) / exchange_bw  # the slices a feeder takes from its peers
    terms["pack"] = busiest / memcpy
    terms["hash"] = busiest / hasher + shard / hasher  # digests where each slice is built, and where it lands
    terms["link"] = max(busiest, shard) / link
    terms["verify"] = shard / hasher if verify else 0.0
    terms["per_call"] = num_buckets * costs.per_bucket_s + num_tensors * costs.per_tensor_s
    fixed = costs.per_sync_s + costs.per_engine_s * engines.count
    pause = fixed + sum(terms.values())
    terms["per_call"] += fixed
    return Projection(
        transport=Transport.P2P,
        sync_s=pause,
        pause_s=pause,
        stage_s=0.0,
        sender_extra_bytes=int(min(bucket_bytes, shard) * math.ceil(engines.num_ranks / feeders)),
        engine_rank_extra_bytes=0,  # received in place
        num_bytes=total,
        num_tensors=num_tensors,
        num_buckets=num_buckets,
        terms=terms,
    )
