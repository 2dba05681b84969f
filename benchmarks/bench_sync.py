"""Sync throughput, scaling and overheads, side by side against baselines and this machine's ceiling, in one run.

    python benchmarks/bench_sync.py [--quick] [--parallel-only] [--tp-only] [--p2p-only] [--models-only] [--json PATH]
        [--png PATH] [--cache DIR] [--repetitions N] [--repeats N] [--models NAMES] [--compare COMMIT]

Every figure is a ratio of things measured in the same run (the machine is shared and noisy). Per model (Qwen3
shapes from ~20M to ~500M parameters, `--quick`: up to ~100M; see _sync_models.py), against reference engines
started from the same checkpoint:

  (a) miles_sync, distributed: SyncController + Sender over a gloo update group (flattened buckets, double-buffered);
  (b) per-tensor baseline: the same session, but one metadata POST and one broadcast per tensor, the tensor's own
      bytes, no packing (what Miles and OpenRLHF send);
  (c) Ray object store at its best: one `ray.put` of the state dict as numpy arrays, `ray.get` (zero-copy) in one
      actor per engine, copied into preallocated tensors;
  (d) ceiling: one gloo broadcast of a single contiguous buffer of the same bytes among the same number of
      processes (sender + engines) on this host, the fastest of 5 (as memcpy and SHA-256, the costs bounds are
      built from: the best this machine does, which holds from run to run);
  colocated: miles_sync's shared-memory path vs a pickled copy through a pipe into another process vs one memcpy,
      into one TP=1 engine (one pack and one load: the two-copy bound the colocated target is set against, the shape
      of a colocated deployment, where each engine's GPUs hold the trainer ranks that feed it) and into both engines
      (one pack, two loads sharing this host's two cores and memory bus).

Pause window / sync wall with staged export, per model: verified against the same 2 engines answering SGLang's
checker digests (`--checksum-names engine`: engine parameters per TP rank, what `pause_fraction` reports; the
layout digests they are checked against predicted ahead of the pause, and in it for comparison) and against the
reference engines' HF digests (`pause_fraction_hf_digests`). For the largest model, the share of the machine's cores
the sender and the engines kept busy over each series (`cpu_busy_*`: near 1, the cores bound it), and the highest
`ratio_vs_ceiling` this machine's cores allow a verified send (`ratio_vs_ceiling_cpu_bound`: the ceiling's own CPU
time over its processes, one memcpy per engine and the sender's SHA-256 of the bytes, all measured in the run, over
the core count).

Sweeps on the largest model of the run: bucket size (16 MiB to 1 GiB; quick: to 256 MiB) with the peak RSS growth
of the sending process and of one engine; 1 to 4 engines; and
one TP=1 engine against one TP=2 engine (`serve --tp-size 2`: an HTTP front and 2 rank processes), distributed,
colocated and shard_direct, verify off, with the bytes each engine rank took in per sync as the engine counts them
(`miles_sync_received_bytes` in its server info: broadcasts received, payload tensors mapped; for distributed also
the TCP bytes its sockets received, read from the kernel's tcp_info with `ss`) and the CPU seconds the sender and the
engine's processes used per sync (`shard_direct_vs_colocated_tp2_cpu_s` beside the wall-time ratio: what the cores
allow when both are CPU-bound).

How each figure is taken (benchmarks/_repeat.py): every case of a comparison runs once per repetition, in the same
order (A, B, ..., A, B, ...; `--repetitions`, default 5, least 3), each run a series of its own: a fresh controller,
one warm-up sync that is not measured (group set-up, first touch of buffers), then `--repeats` measured syncs whose
median is the series' figure (default 3 below 256 MiB, 1 above). Every figure is computed per repetition (a ratio
from its two cases of the same repetition) and reported as the median over the repetitions. The layout sections
(parallel pair, fed cases, FP8/LoRA/draft guard) and the per-model pairs (TP comparison, engine-digest pair), whose
ratios sit near 1.0 or are small shares, take at least 5 repetitions whatever `--repetitions` says; the TP comparison
runs one discarded pass first (its TP=2 engine starts there) and its series take at least 3 measured syncs whatever
the model's size, the fed and p2p cases 5 syncs in each of at least 9 repetitions (a sync of any of them takes a
fraction of a second). `spread` in the JSON
keeps each headline figure's median, min, max and every repetition's value, the printout says `median [min-max]`,
a figure whose max/min exceeds 1.2 is listed in `unstable`, and `caveats` says why a figure cannot be read as what it
names (unstable; the CPU bound saturated at 1.0 because the model is too small for the cores to bound its send; the
largest model fitting one bucket, so the send is not pipelined). Phase times come from the SyncReport the
controller returns. `--compare COMMIT` runs this script from a checkout of COMMIT and from this one, alternating,
and prints each key's ratio (benchmarks/bench_compare.py).

Parallel trainer layouts (_parallel_sync.py; `--parallel-only` runs just these): real trainer actors (megatron-core
on CPU) and the controller actor against 2 reference engines, distributed, verify on and off. A dense Qwen3 synced
by tp=1 pp=2 (one source and update group per stage) against pp=1, and a synthetic Qwen3-MoE by tp=1 dp=2 ep=2
(experts gathered to the source) against ep=1: GB/s on send and on total, export s, the ratio to the baseline, and
the expert gather's cost (EP=2 export - EP=1 export).

Top-level JSON keys (medians over the repetitions; from the largest model unless said): ratio_vs_ceiling (and
ratio_vs_ceiling_cpu_bound), end_to_end_gbps (a host rate: printed, not a headline key, HOST_RATE_KEYS),
speedup_vs_per_tensor (model with the most tensors),
colocated_vs_memcpy (one TP=1 engine; colocated_vs_memcpy_tp2 into one TP=2 engine against a memcpy measured
beside it in the TP comparison; colocated_vs_memcpy_two_engines), pause_fraction (and pause_fraction_hf_digests),
peak_extra_mem_over_bucket; then the tables (the TP comparison is the largest model's `tp_cases`), `parallel` (the
parallel layouts), torch/ray versions and the core count; `spread`, `unstable`, `caveats`, `section_repetitions`
(each section's count) and `repetitions` (the least of them); per model, `spread` and every repetition's row of its
core cases (`repetitions`), of its engine-digest pair (`digest_repetitions`) and of the TP comparison
(`tp_repetitions`), these two at least LAYOUT_REPETITIONS.

FP8 vs BF16 (bench_fp8.py's comparison, on the run's smallest model, 128x128 blocks): bytes on the wire, sync wall
and the source's quantization time as a share of it. LoRA vs full (bench_lora.py's comparison, same model, rank 16
on q/k/v/o/gate/up/down, colocated into one LoRA-serving engine): bytes sent, sync wall and pause window. `topologies`
holds one key per layout compared side by side (engine TP=2 vs 1, PP=2 concurrent stage sources vs one gathered
source, EP=2 vs 1, FP8 vs BF16, LoRA vs full, colocated vs distributed, layout digests predicted ahead of the
pause vs in it, the draft guard's checker call vs the target-only one), each a ratio of two measurements of this
run; `commit` names the checkout that produced the JSON.

Draft guard (bench_draft_guard.py's comparison, same model plus a frozen MTP layer, 2 engines): the verification's
checker call with the draft (selector `all`, what every guarded sync issues) against the target-only call,
alternated; the difference as a share of the guarded sync's verify phase and wall (`draft_guard`).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import json
import math
import os
import platform
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _baselines import (  # noqa: E402
    ceiling_broadcast,
    memcpy_seconds,
    pickled_copy_seconds,
    ray_object_store_seconds,
    received_per_pid,
    sha256_seconds,
    tcp_bytes_received,
    verified_cpu_bound,
)
from _fed_sync import bench_fed, print_fed_table, received_bytes  # noqa: E402
from _p2p_sync import bench_p2p, p2p_topologies, print_p2p_table  # noqa: E402
from _parallel_sync import bench_parallel, print_parallel_table  # noqa: E402
from _procstat import PeakSampler, cpu_seconds, rss_bytes  # noqa: E402
from _repeat import MIN_REPETITIONS, UNSTABLE_SPREAD, Spread, alternate, is_number, median_of, spreads_of  # noqa: E402
from _sync_models import (  # noqa: E402
    CALL_TIMEOUT_S,
    FULL_MODELS,
    MODELS,
    QUICK_MODELS,
    ModelSpec,
    benchmark_controller,
    checkpoint_dir,
    export_units,
    pause_window_s,
    tensor_sender,
)
from bench_compare import compare_main, git_commit  # noqa: E402
from bench_draft_guard import bench_draft_guard_model  # noqa: E402
from bench_fp8 import bench_model as bench_fp8_model  # noqa: E402
from bench_lora import bench_model as bench_lora_model  # noqa: E402

from miles_sync.engine.client import EngineClient
from miles_sync.engine.process import EngineLauncher
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.reference.models import read_safetensors  # noqa: E402
from miles_sync.env import adopt_bind_host
from miles_sync.sync.engine_digests import EngineDigestPlan
from miles_sync.sync.report import BucketProgress, SyncReport
from miles_sync.sync.sender import Sender
from miles_sync.sync.update_group import GroupSettings
from miles_sync.sync.weight_source import SendResult, StageResult, WeightSource
from miles_sync.transport.base import EngineTarget  # noqa: E402
from miles_sync.transport.distributed import DistributedTransport  # noqa: E402
from miles_sync.transport.membership import (
    EngineEndpoint,
    GroupMembership,  # noqa: E402
)
from miles_sync.wire.bucket import BucketEntry, FlattenedBucket
from miles_sync.wire.protocol import ChecksumNames, Selector

MIB = 2**20
HOST = "127.0.0.1"
DEFAULT_BUCKET = 256 * MIB
ENGINES = 2  # per model; the engine sweep goes to 4
ENGINE_TP = 2  # the TP case's engine, measured against a TP=1 engine
SMALL_SERIES_SYNCS = 3  # measured syncs per series below 256 MiB (series_syncs)
# The TP comparison's series take the median of at least this many syncs whatever the model's size: its headline
# ratio (tp2_vs_tp1_total_s) is one sync of each engine against the other, and at one sync per series (the sweep
# model is above 256 MiB) the TP=1 engine's distributed sync alone ranged 0.52-1.23 s within one run, which moved
# the median of 5 repetitions 1.40 / 1.12 between two full runs of one commit.
TP_SERIES_SYNCS = 3
# The fed cases' counted syncs per controller: each takes 0.15-0.45 s of qwen3-55m, where one scheduling hiccup of
# the six processes sharing 2 cores is a large share; the median of 3 moved fed tp1dp2 -> tp2's shard_direct over
# colocated 0.92 / 1.26 between two full runs of one commit. More syncs cost seconds, not minutes.
FED_SERIES_SYNCS = 5
# And the fed cases take at least this many repetitions: with 5 syncs per series, their colocated syncs still ranged
# 0.34-0.84 s within one run (slow spells of the host last longer than a series), and two `--tp-only` runs of one
# commit gave trainer tp2 -> engine tp2's shard_direct over colocated 0.32 / 0.41 at 5 repetitions.
FED_REPETITIONS = 9
# The p2p cases are the same kind of figure (0.2-0.45 s syncs of qwen3-55m, CPU seconds read in 10 ms ticks) and
# take the fed cases' counts too: at 5 repetitions of 3 syncs, p2p into two TP=1 engines' CPU-seconds ratio moved
# 1.38 / 1.67 between two full runs of one commit, its repetitions 1.10-1.63 in one, 1.34-1.78 in the other.
# The layout sections (pipeline/expert pair, fed cases, FP8/LoRA/draft guard) take at least this many repetitions:
# their ratios sit near 1.0 or are small shares, where the median of 3 moved by 22-39% between three quick runs on
# one commit (pp2_vs_pp1 0.75/0.92/0.75, fed tp1dp2->tp2 1.00/0.84/1.16, fp8_quantize_share 0.27/0.23/0.21). So do
# the per-model pairs a headline key is one ratio of (the TP comparison, the engine-digest pair): at 3 they moved by
# 24-25% (colocated_vs_memcpy_tp2 0.39/0.39/0.31, staged_pause ahead/in 0.77/0.87/0.95). And the core cases' colocated
# ratios at 3 moved by 21-23% over three quick runs (colocated_vs_memcpy 0.32/0.28/0.26): 5 is every section's default.
LAYOUT_REPETITIONS = 5
# Peaks: a high-water mark is what a user provisions for, so its figure is the largest repetition, not the median.
# The sender's peak at a 64 MiB bucket is bimodal on this host (96 or 123 MiB over a bucket's 64, about half the
# repetitions each): the median of 5 landed on either mode from run to run (1.93 / 1.93 / 1.51).
PEAK_KEYS = frozenset({"peak_extra_mem_over_bucket"})
# Absolute rates follow the host's speed at the hour of the run (this machine's memcpy measured 6.3 and 14.7 GB/s in
# two sessions; end_to_end_gbps 0.51 / 0.47 / 0.58 over three quick runs of one commit whose 47 ratios held within
# 20%): they are printed and kept in the JSON, with their spread within the run, but are no headline key, since a
# figure that moves with the host cannot hold a target or compare two commits. `ratio_vs_ceiling` is the same sync
# against the ceiling broadcast measured beside it in each repetition: that is the headline figure for it.
HOST_RATE_KEYS = frozenset({"end_to_end_gbps"})


def log(message: str) -> None:
    print(f"[bench_sync {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("nan")


# ---- sources --------------------------------------------------------------------------------------------------


def model_sender(tensors: dict[str, torch.Tensor], *, transport: str, bucket_bytes: int, verify: bool) -> Sender:
    # hash_buckets follows verify, as miles_sync.embedding.sender_settings sets it
    return tensor_sender(tensors, transport=transport, bucket_bytes=bucket_bytes, hash_buckets=verify)


class PerTensorSource(WeightSource):
    """Baseline (b), a WeightSource: per tensor, one `update_weights_from_distributed` POST naming it and one
    broadcast of its own bytes (a single-tensor flattened bucket is byte-for-byte the tensor: no copy). Sends no
    checksums, so it runs with verify off."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._clients: list[EngineClient] = []
        self._transport: DistributedTransport | None = None

    async def exported_names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None:
        await self.close()
        self._clients = [EngineClient(e.url, timeout_s=CALL_TIMEOUT_S) for e in engines]
        transport = DistributedTransport(
            engines=[EngineTarget(client=c, tp_size=e.tp_size) for c, e in zip(self._clients, engines)]
        )
        bound = await transport.open(membership=membership, timeout_s=CALL_TIMEOUT_S)
        self._transport = transport
        return bound

    async def send(
        self,
        *,
        selector: Selector,
        on_bucket: Callable[[BucketProgress], None] | None = None,
        engine_digests: EngineDigestPlan | None = None,
    ) -> SendResult:
        """Predicts no engine digests (it runs with verify off)."""
        assert self._transport is not None, "open() first"
        start, num_bytes = time.perf_counter(), 0
        for name, tensor in self._tensors.items():
            raw = tensor.reshape(-1).view(torch.uint8)
            entry = BucketEntry(name=name, shape=tuple(tensor.shape), dtype=tensor.dtype, start=0, end=raw.numel())
            bucket = FlattenedBucket(buffer=raw, entries=(entry,))
            await self._transport.send_bucket(bucket, selector=selector, timeout_s=CALL_TIMEOUT_S)
            num_bytes += raw.numel()
        return SendResult(
            num_bytes=num_bytes,
            num_buckets=len(self._tensors),
            num_tensors=len(self._tensors),
            checksums={},
            export_s=0.0,
            pack_s=0.0,
            send_s=time.perf_counter() - start,
        )

    async def close(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            await transport.close(timeout_s=CALL_TIMEOUT_S)
        for client in self._clients:
            await client.close()
        self._clients = []


class DigestsInPause(WeightSource):
    """A Sender whose `stage()` takes no engine-digest plan, so a staged send predicts the engines' layout digests
    inside the pause (what every staged sync did before stage() took the plan): the baseline of the engine-digest
    comparison."""

    def __init__(self, sender: Sender) -> None:
        self._sender = sender

    async def exported_names(self) -> tuple[str, ...]:
        return await self._sender.exported_names()

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None:
        return await self._sender.open(engines=engines, membership=membership)

    can_stage = True

    async def stage(
        self, *, selector: Selector | None = None, engine_digests: EngineDigestPlan | None = None
    ) -> StageResult:
        """Packs ahead without the plan: the next send predicts the engine digests inside the pause."""
        return await self._sender.stage()

    async def send(self, **options) -> SendResult:
        return await self._sender.send(**options)

    async def close(self) -> None:
        await self._sender.close()


# ---- syncs ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Measured:
    """The median sync of a series (by wall time) and what the sampler saw during the measured syncs."""

    report: SyncReport
    sender_peak_bytes: int = 0  # over the sender's RSS before the series (its buffers live as long as the Sender)
    engine_peak_bytes: int = 0  # over the RSS the engine had right after it started (its receive buffer persists)
    tcp_received: dict[int, float] = field(default_factory=dict)  # per counted pid: TCP bytes per measured sync
    # CPU time the sender and the engines used over the measured syncs, over their wall time times the machine's
    # cores: near 1, the machine's cores (not a wait) bound the series.
    cpu_busy: float = float("nan")
    cpu_s: float = float("nan")  # that CPU time itself, over the measured syncs
    num_syncs: int = 0  # syncs of the series, the warm-up included


def run_syncs(
    urls: Sequence[str],
    source,
    *,
    transport: str,
    verify: bool,
    repeats: int,
    staged: bool = False,
    sample_pids: Sequence[int] = (),
    engine_start_rss: dict[int, int] | None = None,
    count_pids: Sequence[int] = (),
    cpu_pids: Sequence[int] = (),
) -> Measured:
    async def go() -> Measured:
        controller = benchmark_controller(
            list(urls),
            source,
            transport=transport,
            verify=verify,
            staged=staged,
            group=GroupSettings(master_address=HOST),
        )
        # Sampled from before the first sync: buffers kept between syncs count as the sync's memory too. Free heap
        # left by earlier measurements goes back to the OS first, so that it neither hides nor inflates the growth.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        sampler = PeakSampler(sample_pids).start() if sample_pids else None
        await controller.connect()
        try:
            await controller.sync()  # warm-up: group set-up, first-touch of buffers
            # Counted over the measured syncs only, before the group's sockets close with the controller.
            before = tcp_bytes_received(count_pids)
            cpu_before, wall_before = {p: cpu_seconds(p) for p in cpu_pids}, time.perf_counter()
            reports = [await controller.sync() for _ in range(repeats)]
            wall_s = time.perf_counter() - wall_before
            cpu_s = sum(cpu_seconds(p) - c for p, c in cpu_before.items())
            cpu_busy = cpu_s / (wall_s * (os.cpu_count() or 1)) if cpu_pids else float("nan")
            received = received_per_pid(before, tcp_bytes_received(count_pids), pids=count_pids, repeats=repeats)
        finally:
            await controller.close()
            await source.close()
            peaks = {} if sampler is None else sampler.stop()
        median = sorted(reports, key=lambda r: r.total_s)[len(reports) // 2]
        if sampler is None:
            return Measured(report=median, tcp_received=received, cpu_busy=cpu_busy, cpu_s=cpu_s, num_syncs=repeats + 1)
        sender, *engines = sample_pids
        start_rss = engine_start_rss or {}
        engine_peak = max((sampler.peak[p] - start_rss.get(p, sampler.baseline[p]) for p in engines), default=0)
        return Measured(
            report=median,
            sender_peak_bytes=peaks[sender],
            engine_peak_bytes=engine_peak,
            tcp_received=received,
            cpu_busy=cpu_busy,
            cpu_s=cpu_s,
            num_syncs=repeats + 1,
        )

    measured = asyncio.run(go())
    if not measured.report.committed:
        raise RuntimeError(f"benchmark sync failed: {measured.report.summary()}")
    return measured


# ---- engines --------------------------------------------------------------------------------------------------


class EngineFleet:
    """`count` reference engines of `tp_size` ranks each on one checkpoint; stopped on exit."""

    def __init__(
        self,
        stack: ExitStack,
        model_dir: Path,
        *,
        count: int,
        log_dir: Path,
        tp_size: int = 1,
        checksum_names: ChecksumNames | None = None,
    ) -> None:
        self.launchers = []
        spec = ReferenceEngineSpec(model_dir=str(model_dir), tp_size=tp_size, checksum_names=checksum_names)
        for _ in range(count):
            launcher = EngineLauncher(spec=spec, log_dir=log_dir)
            stack.callback(launcher.stop)
            launcher.start()
            self.launchers.append(launcher)
        self.start_rss = {pid: rss_bytes(pid) for pid in self.pids}

    def urls(self, count: int | None = None) -> list[str]:
        return [launcher.url for launcher in self.launchers[:count]]

    def stop(self) -> None:
        """Stop every engine now (stopping again on exit is harmless)."""
        for launcher in self.launchers:
            launcher.stop()

    @property
    def pids(self) -> list[int]:
        return [launcher.pid for launcher in self.launchers]

    def received_bytes(self, index: int) -> list[int]:
        """Per TP rank of engine `index`, the bytes of tensor data it took in since it started, as the engine itself
        counts them (broadcasts received, payload tensors mapped)."""
        return received_bytes([self.launchers[index].url])

    def rank_pids(self, index: int) -> list[int]:
        """The processes holding engine `index`'s weights: its TP rank processes, or at TP=1 the engine itself."""
        launcher = self.launchers[index]
        with urllib.request.urlopen(f"{launcher.url}/get_server_info", timeout=CALL_TIMEOUT_S) as response:
            state = json.load(response)["internal_states"][0]
        return [int(pid) for pid in state["tp_rank_pids"]] or [launcher.pid]


def digest_case(m: Measured) -> dict:
    """One staged, verified series into engines answering engine-parameter digests: where its wall time went."""
    report = m.report
    return {
        "verification": report.verification,
        "stage_s": report.phases.stage_s,
        "pause_window_s": pause_window_s(report),
        "total_s": report.total_s,
        "pause_fraction": pause_window_s(report) / report.total_s,
        "phases": vars(report.phases),
        "cpu_busy": m.cpu_busy,
    }


def tp_case_row(
    m: Measured,
    *,
    transport: str,
    engine_tp: int,
    rank_pids: Sequence[int],
    received: Sequence[float],
    model_bytes: int,
) -> dict:
    """One row of the TP comparison. `received`: per engine rank, the bytes the engine counted itself taking in per
    sync (measured: broadcasts received, payload tensors mapped). Distributed also keeps the TCP bytes each rank's
    sockets received (the kernel's count, a cross-check); colocated and shard_direct payloads travel as
    shared-memory handles no socket sees."""
    report = m.report
    tcp = [m.tcp_received.get(pid, float("nan")) for pid in rank_pids]
    return {
        "transport": transport,
        "engine_tp": engine_tp,
        "send_gbps": gbps(report.num_bytes, report.phases.send_s),
        "send_s": report.phases.send_s,
        "total_s": report.total_s,
        "bytes_sent": report.num_bytes,
        "buckets": report.num_buckets,
        "bytes_per_rank": list(received),
        "bytes_per_rank_basis": "measured",
        "recv_per_rank_over_model": max(received) / model_bytes,
        "tcp_bytes_per_rank": tcp,  # distributed only: the group's sockets; nothing carries the others' bytes
        "cpu_s": m.cpu_s / max(1, m.num_syncs - 1),  # per measured sync, the sender and the engine's processes
    }


# ---- the run --------------------------------------------------------------------------------------------------


def bench_model(spec: ModelSpec, args, *, is_sweep_model: bool) -> dict:
    """Every case of one model in `args.repetitions` alternating repetitions (_repeat.py); the row holds each
    figure's median over them, `spread` the headline figures' spreads and `repetitions` every repetition's row."""
    model_dir = checkpoint_dir(spec, args.cache)
    tensors = read_safetensors(model_dir / "model.safetensors")
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    num_params = sum(t.numel() for t in tensors.values())
    num_engines = 4 if is_sweep_model else ENGINES
    log(
        f"{spec.name}: {num_params / 1e6:.0f}M params, {len(tensors)} tensors, {num_bytes / MIB:.0f} MiB; "
        f"starting {num_engines} engines"
    )
    largest_unit = max(u.meta.num_bytes for u in export_units(tensors))
    row: dict = {
        "model": spec.name,
        "params": num_params,
        "tensors": len(tensors),
        "bytes": num_bytes,
        "largest_unit_bytes": largest_unit,
    }
    r, reps = args.repeats or series_syncs(num_bytes), args.repetitions
    row["syncs_per_series"] = r
    with ExitStack() as stack:
        fleet = EngineFleet(stack, model_dir, count=num_engines, log_dir=args.log_dir)
        urls = fleet.urls(ENGINES)
        pids = [os.getpid(), *fleet.pids[:ENGINES]]

        def ours(
            transport: str,
            *,
            verify: bool,
            bucket: int = DEFAULT_BUCKET,
            staged: bool = False,
            engine_urls: Sequence[str] = urls,
            sample: bool = False,
            count_pids: Sequence[int] = (),
            cpu_pids: Sequence[int] = pids,
            digests_in_pause: bool = False,
            syncs: int = r,
        ) -> Measured:
            sender = model_sender(tensors, transport=transport, bucket_bytes=bucket, verify=verify)
            return run_syncs(
                engine_urls,
                DigestsInPause(sender) if digests_in_pause else sender,
                transport=transport,
                verify=verify,
                repeats=syncs,
                staged=staged,
                sample_pids=pids if sample else (),
                engine_start_rss=fleet.start_rss,
                count_pids=count_pids,
                cpu_pids=cpu_pids,
            )

        log(f"{spec.name}: (a)-(d), colocated, pickled copy, memcpy; {reps} alternating repetitions")
        core = alternate(
            [
                ("(a) distributed, verified", lambda: ours("distributed", verify=True, sample=True)),
                ("(a) distributed, unverified", lambda: ours("distributed", verify=False)),
                (
                    "(b) per-tensor",
                    lambda: run_syncs(urls, PerTensorSource(tensors), transport="distributed", verify=False, repeats=r),
                ),
                ("(c) Ray object store", lambda: ray_object_store_seconds(tensors, num_engines=ENGINES, repeats=r)),
                ("(d) ceiling", lambda: ceiling_broadcast(num_bytes, world_size=ENGINES + 1, repeats=r)),
                (
                    "colocated, one engine",
                    lambda: ours("colocated", verify=False, engine_urls=urls[:1], cpu_pids=pids[:2]),
                ),
                ("colocated, two engines", lambda: ours("colocated", verify=False)),
                ("colocated, staged", lambda: ours("colocated", verify=False, staged=True)),
                ("colocated, verified", lambda: ours("colocated", verify=True)),
                ("pickled copy", lambda: pickled_copy_seconds(tensors, repeats=r)),
                ("memcpy", lambda: memcpy_seconds(tensors, repeats=r)),
                ("sha256", lambda: sha256_seconds(tensors, repeats=r)),
                ("distributed, staged, verified", lambda: ours("distributed", verify=True, staged=True)),
            ],
            repetitions=reps,
            log=log,
        )
        # The pause fraction as the sync-speed target defines it: verified on the digests SGLang's checker answers
        # (engine parameters), the same two TP=1 engines otherwise; the layout digests predicted ahead of the
        # pause (stage() takes the plan), and in it for comparison.
        log(f"{spec.name}: staged and verified into {ENGINES} engines answering SGLang's engine-parameter digests")
        sglang_named = EngineFleet(
            stack, model_dir, count=ENGINES, log_dir=args.log_dir, checksum_names=ChecksumNames.ENGINE
        )
        named_pids = [os.getpid(), *sglang_named.pids]

        def digests(in_pause: bool) -> dict:
            m = ours(
                "distributed",
                verify=True,
                staged=True,
                engine_urls=sglang_named.urls(),
                cpu_pids=named_pids,
                digests_in_pause=in_pause,
            )
            return digest_case(m)

        pair_reps = max(reps, LAYOUT_REPETITIONS)  # one ratio of two cases is a headline key
        digest_cases = alternate(
            [("engine_digests_in_pause", lambda: digests(True)), ("engine_digests_staged", lambda: digests(False))],
            repetitions=pair_reps,
            log=log,
        )
        sglang_named.stop()  # its memory is the sweeps' from here on
        rows = [row | core_row({name: c[i] for name, c in core.items()}, num_bytes=num_bytes) for i in range(reps)]
        digest_reps = [{name: runs[i] for name, runs in digest_cases.items()} for i in range(pair_reps)]
        tp_reps = None
        if is_sweep_model:
            for i, sweeps in enumerate(sweep_rows(spec, args, fleet=fleet, ours=ours, num_bytes=num_bytes)):
                rows[i].update(sweeps)
            tp_reps = tp_cases(
                spec,
                args,
                stack=stack,
                model_dir=model_dir,
                fleet=fleet,
                ours=ours,
                memcpy=lambda: memcpy_seconds(tensors, repeats=r),
            )
    tensors = None  # release the model before the next one loads (closures above still name it)
    row.update(median_of(rows))
    row["spread"] = {k: s.to_json() for k, s in spreads_of(rows).items()}
    row["repetitions"] = rows
    row.update(median_of(digest_reps))
    row["digest_repetitions"] = digest_reps
    if tp_reps is not None:
        row.update(median_of(tp_reps))
        row["tp_repetitions"] = tp_reps
    return row


def series_syncs(num_bytes: int) -> int:
    """Measured syncs per series (their median is the series' figure) when --repeats is not given: 3 below
    256 MiB, where one sync takes a fraction of a second and a stray scheduling hiccup is a large share of it; 1
    above, where syncs take seconds and the repetitions alone keep the run's length in bounds."""
    return SMALL_SERIES_SYNCS if num_bytes < 256 * MIB else 1


def core_row(runs: dict, *, num_bytes: int) -> dict:
    """One repetition's figures from its core cases (`bench_model`'s names)."""
    verified_measured = runs["(a) distributed, verified"]
    verified = verified_measured.report
    unverified = runs["(a) distributed, unverified"].report
    per_tensor = runs["(b) per-tensor"].report
    ceiling = runs["(d) ceiling"]
    colocated_measured = runs["colocated, one engine"]
    colocated = colocated_measured.report
    colocated_two_engines = runs["colocated, two engines"].report
    colocated_staged = runs["colocated, staged"].report
    colocated_verified = runs["colocated, verified"].report
    memcpy_s, sha256_s = runs["memcpy"], runs["sha256"]
    staged_measured = runs["distributed, staged, verified"]
    staged = staged_measured.report
    return dict(
        ours_send_gbps=gbps(num_bytes, verified.phases.send_s),
        ours_end_to_end_gbps=gbps(num_bytes, verified.total_s),
        ours_total_s=verified.total_s,
        ours_unverified_total_s=unverified.total_s,
        ours_buckets=verified.num_buckets,
        phases=vars(verified.phases) | {"total_s": verified.total_s},
        per_tensor_total_s=per_tensor.total_s,
        per_tensor_send_gbps=gbps(num_bytes, per_tensor.phases.send_s),
        speedup_vs_per_tensor=per_tensor.total_s / unverified.total_s,
        ray_gbps=gbps(num_bytes, runs["(c) Ray object store"]),
        ceiling_gbps=gbps(num_bytes, ceiling.seconds),
        ratio_vs_ceiling=gbps(num_bytes, verified.phases.send_s) / gbps(num_bytes, ceiling.seconds),
        # What bounds ratio_vs_ceiling on this machine's cores: the ceiling's CPU time (all its processes), one
        # memcpy per engine and the sender's SHA-256, each measured here.
        ceiling_cpu_s=ceiling.cpu_s,
        sha256_gbps=gbps(num_bytes, sha256_s),
        ratio_vs_ceiling_cpu_bound=verified_cpu_bound(
            ceiling=ceiling, memcpy_s=memcpy_s, sha256_s=sha256_s, engines=ENGINES, cores=os.cpu_count() or 1
        ),
        colocated_send_gbps=gbps(num_bytes, colocated.phases.send_s),
        pickled_copy_gbps=gbps(num_bytes, runs["pickled copy"]),
        memcpy_gbps=gbps(num_bytes, memcpy_s),
        colocated_vs_memcpy=gbps(num_bytes, colocated.phases.send_s) / gbps(num_bytes, memcpy_s),
        colocated_two_engines_send_gbps=gbps(num_bytes, colocated_two_engines.phases.send_s),
        colocated_two_engines_vs_memcpy=gbps(num_bytes, colocated_two_engines.phases.send_s)
        / gbps(num_bytes, memcpy_s),
        # Staged: packing and hashing ran before the pause, the send phase is the engines' loading only.
        colocated_verified_send_gbps=gbps(num_bytes, colocated_verified.phases.send_s),
        colocated_staged_send_gbps=gbps(num_bytes, colocated_staged.phases.send_s),
        staged_send_gbps=gbps(num_bytes, staged.phases.send_s),
        pause_fraction_unstaged=pause_window_s(verified) / verified.total_s,
        pause_fraction_staged=pause_window_s(staged) / staged.total_s,
        staged_phases=vars(staged.phases) | {"total_s": staged.total_s},
        staged_extra_bytes=num_bytes,  # stage() holds every packed bucket until the send
        # Share of the machine's cores the sender and engines kept busy over each series (run_syncs).
        cpu_busy_verified=verified_measured.cpu_busy,
        cpu_busy_staged=staged_measured.cpu_busy,
        cpu_busy_colocated=colocated_measured.cpu_busy,
    )


def sweep_rows(spec: ModelSpec, args, *, fleet: EngineFleet, ours, num_bytes: int) -> list[dict]:
    """The bucket sweep (send GB/s and peak RSS growth per bucket size) and the engine sweep (1 to all of `fleet`'s
    engines), alternating repetitions; one `{bucket_sweep, engine_sweep}` per repetition."""
    counts = range(1, len(fleet.pids) + 1)
    runs = alternate(
        [
            *(
                (f"bucket {mib} MiB", lambda mib=mib: ours("distributed", verify=True, bucket=mib * MIB, sample=True))
                for mib in args.bucket_sweep
            ),
            *(
                (f"{n} engine(s)", lambda n=n: ours("distributed", verify=True, engine_urls=fleet.urls(n)))
                for n in counts
            ),
        ],
        repetitions=args.repetitions,
        log=log,
    )
    out = []
    for i in range(args.repetitions):
        buckets = []
        for mib in args.bucket_sweep:
            m = runs[f"bucket {mib} MiB"][i]
            buckets.append(
                {
                    "bucket_mib": mib,
                    "buckets": m.report.num_buckets,
                    "send_gbps": gbps(num_bytes, m.report.phases.send_s),
                    "total_s": m.report.total_s,
                    "sender_peak_extra_mib": m.sender_peak_bytes / MIB,
                    "engine_peak_extra_mib": m.engine_peak_bytes / MIB,
                    "sender_extra_over_bucket": m.sender_peak_bytes / (mib * MIB),
                    "engine_extra_over_bucket": m.engine_peak_bytes / (mib * MIB),
                }
            )
        engines = []
        for n in counts:
            report = runs[f"{n} engine(s)"][i].report
            engines.append(
                {
                    "engines": n,
                    "send_gbps": gbps(num_bytes, report.phases.send_s),
                    "aggregate_send_gbps": n * gbps(num_bytes, report.phases.send_s),
                    "total_s": report.total_s,
                    "phases": vars(report.phases),
                }
            )
        out.append({"bucket_sweep": buckets, "engine_sweep": engines})
    return out


def tp_cases(
    spec: ModelSpec,
    args,
    *,
    stack: ExitStack,
    model_dir: Path,
    fleet: EngineFleet,
    ours,
    memcpy: Callable[[], float],
) -> list[dict]:
    """The TP comparison: one TP=1 engine (`fleet`'s first) against one TP=2 engine started here, per transport,
    and this process's memcpy of the model (`memcpy()`, seconds) as the colocated bound, every case in each of at
    least LAYOUT_REPETITIONS alternating repetitions; `ours(transport, **options)` runs one measured series (the
    median of at least TP_SERIES_SYNCS syncs). Per repetition `{tp_cases: [case rows], tp_memcpy_gbps}`."""
    num_bytes = sum(t.numel() * t.element_size() for t in read_safetensors(model_dir / "model.safetensors").values())
    log(f"{spec.name}: one TP=1 engine vs one TP={ENGINE_TP} engine")
    tp_fleet = EngineFleet(stack, model_dir, count=1, log_dir=args.log_dir, tp_size=ENGINE_TP)
    fleets = {1: fleet, ENGINE_TP: tp_fleet}  # the first engine of each
    rank_pids = {engine_tp: f.rank_pids(0) for engine_tp, f in fleets.items()}

    def case(transport: str, engine_tp: int) -> dict:
        f = fleets[engine_tp]
        before = f.received_bytes(0)
        m = ours(
            transport,
            verify=False,
            engine_urls=f.urls(1),
            count_pids=rank_pids[engine_tp],
            cpu_pids=[os.getpid(), f.pids[0], *rank_pids[engine_tp]],
            syncs=max(args.repeats or 0, TP_SERIES_SYNCS),
        )
        received = [(a - b) / m.num_syncs for a, b in zip(f.received_bytes(0), before)]
        return tp_case_row(
            m,
            transport=transport,
            engine_tp=engine_tp,
            rank_pids=rank_pids[engine_tp],
            received=received,
            model_bytes=num_bytes,
        )

    keys = [(t, tp) for t in ("distributed", "colocated", "shard_direct") for tp in fleets]
    repetitions = max(args.repetitions, LAYOUT_REPETITIONS)
    # One discarded pass first: in every quick run the first repetition's TP=2 cases were the slow ones (the TP=2
    # engine and its rank processes start here), which moved tp2_vs_tp1_total_s 1.22-1.51 between runs.
    runs = alternate(
        [(f"{t} into the TP={tp} engine", lambda t=t, tp=tp: case(t, tp)) for t, tp in keys] + [("memcpy", memcpy)],
        repetitions=repetitions,
        warmup=1,
        log=log,
    )
    tp_fleet.stop()
    out = []
    for i in range(repetitions):
        rows = [runs[f"{t} into the TP={tp} engine"][i] for t, tp in keys]
        for c in rows:
            tp1 = next(x for x in rows if x["transport"] == c["transport"] and x["engine_tp"] == 1)
            c["send_s_over_tp1"] = c["send_s"] / tp1["send_s"]
            c["total_s_over_tp1"] = c["total_s"] / tp1["total_s"]
        out.append({"tp_cases": rows, "tp_memcpy_gbps": gbps(num_bytes, runs["memcpy"][i])})
    return out


def bench_tp_only(spec: ModelSpec, args) -> dict:
    """`--tp-only`: the TP comparison alone, on one model."""
    model_dir = checkpoint_dir(spec, args.cache)
    tensors = read_safetensors(model_dir / "model.safetensors")
    row: dict = {"model": spec.name, "params": sum(t.numel() for t in tensors.values()), "tensors": len(tensors)}
    row["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    repeats = args.repeats or series_syncs(row["bytes"])
    with ExitStack() as stack:
        fleet = EngineFleet(stack, model_dir, count=1, log_dir=args.log_dir)

        def ours(transport: str, *, verify: bool, engine_urls, count_pids, cpu_pids, syncs: int) -> Measured:
            sender = model_sender(tensors, transport=transport, bucket_bytes=DEFAULT_BUCKET, verify=verify)
            return run_syncs(
                engine_urls,
                sender,
                transport=transport,
                verify=verify,
                repeats=syncs,
                count_pids=count_pids,
                cpu_pids=cpu_pids,
            )

        reps = tp_cases(
            spec,
            args,
            stack=stack,
            model_dir=model_dir,
            fleet=fleet,
            ours=ours,
            memcpy=lambda: memcpy_seconds(tensors, repeats=repeats),
        )
    row.update(median_of(reps))
    row["tp_repetitions"] = reps
    return row


def summarize(rows: list[dict]) -> dict:
    largest = max(rows, key=lambda row: row["params"])
    most_tensors = max(rows, key=lambda row: row["tensors"])
    # Rows where the bucket bounds the buffers: it holds the largest atomic unit (a larger unit travels in a buffer
    # of its own) and is smaller than the model (else the model, not the bucket, is the unit).
    sweep = [
        s
        for s in largest.get("bucket_sweep", [])
        if largest["largest_unit_bytes"] <= s["bucket_mib"] * MIB < largest["bytes"]
    ]
    return {
        "ratio_vs_ceiling": largest["ratio_vs_ceiling"],
        "ratio_vs_ceiling_cpu_bound": largest["ratio_vs_ceiling_cpu_bound"],
        "end_to_end_gbps": largest["ours_end_to_end_gbps"],
        "speedup_vs_per_tensor": most_tensors["speedup_vs_per_tensor"],
        "speedup_model": {"model": most_tensors["model"], "tensors": most_tensors["tensors"]},
        # One pack and one load (one TP=1 engine), the bound the colocated target names; into one TP=2 engine (the
        # TP comparison's colocated case); and into two engines sharing this host's cores.
        "colocated_vs_memcpy": largest["colocated_vs_memcpy"],
        "colocated_vs_memcpy_two_engines": largest["colocated_two_engines_vs_memcpy"],
        # With HF digests, as every run before the engine-digest pair (digest_keys: pause_fraction) reported it.
        "pause_fraction_hf_digests": largest["pause_fraction_staged"],
        # Over the sweep rows whose bucket is smaller than the model (else the model, not the bucket, is the unit).
        "peak_extra_mem_over_bucket": max((s["sender_extra_over_bucket"] for s in sweep), default=float("nan")),
        "largest_model": largest["model"],
    }


def tp2_case(row: dict, transport: str) -> dict | None:
    """The TP comparison's case of `transport` into the TP>1 engine (None for a row without the comparison)."""
    return next((c for c in row.get("tp_cases", []) if c["transport"] == transport and c["engine_tp"] > 1), None)


def model_size(spec: ModelSpec) -> int:
    """Rough parameter count, to pick the sweep (largest) and FP8 (smallest) models of a run."""
    return spec.num_hidden_layers * spec.hidden_size**2 * 12 + spec.vocab_size * spec.hidden_size * 2


def parallel_ratio(section: dict, name: str) -> float:
    """Total GB/s of case `name` over its comparison's first case, verify on (the _parallel_sync rows)."""
    return next(r["total_gbps_ratio"] for r in section["cases"] if (r["case"], r["verify"]) == (name, True))


def topologies(
    rows: list[dict], parallel: dict | None, fp8: dict | None, lora: dict | None, guard: dict | None = None
) -> dict:
    """One key per topology compared side by side in this run; each value is a ratio of two of its measurements
    (time ratios: > 1 is slower than the baseline named after `_vs_`)."""
    out = {}
    if parallel is not None:
        out["pp2_vs_pp1_total_gbps"] = parallel_ratio(parallel["pipeline"], "pp2")
        out["ep2_vs_ep1_total_gbps"] = parallel_ratio(parallel["experts"], "ep2")
    if rows:
        largest = max(rows, key=lambda row: row["params"])
        # both into the same two engines
        out["colocated_vs_distributed_send_gbps"] = (
            largest["colocated_two_engines_send_gbps"] / largest["ours_send_gbps"]
        )
    if fp8 is not None:
        out["fp8_vs_bf16_wire_bytes"] = fp8["wire_bytes_ratio"]
        out["fp8_vs_bf16_sync_s"] = fp8["sync_s_ratio"]
        out["fp8_quantize_share"] = fp8["cases"][1]["quantize_share"]
    if lora is not None:
        out["lora_vs_full_bytes"] = lora["bytes_ratio"]
        out["lora_vs_full_sync_s"] = lora["sync_s_ratio"]
    if guard is not None:
        # The ratio only: the guard's added share of the verify phase (the `draft_guard` section) is a difference of
        # two medians a few milliseconds apart, which moves by 3x between runs and cannot hold a figure.
        out["draft_guard_checker_vs_target_only"] = guard["checker_all_vs_target"]
    return out


def fed_topologies(fed: dict) -> dict:
    """Per fed case, shard_direct over colocated: wall time and the machine's CPU seconds (what the cores allow),
    and the busiest engine rank's bytes over the model."""
    out = {}
    for c in fed["cases"]:
        if c["transport"] != "shard_direct":
            continue
        key = c["case"].replace(" -> ", "_to_").replace(" ", "_")
        out[f"fed_{key}_shard_direct_vs_colocated_total_s"] = c["total_s_over_colocated"]
        out[f"fed_{key}_shard_direct_vs_colocated_cpu_s"] = c["cpu_s_over_colocated"]
        out[f"fed_{key}_shard_direct_recv_per_rank_over_model"] = c["recv_per_rank_over_model"]
    return out


def tp_topologies(tp_row: dict) -> dict:
    """The TP comparison's side-by-side ratios (`topologies`; time ratios > 1 are slower than the case after
    `_vs_`)."""
    tp2 = tp2_case(tp_row, "distributed")
    out = {
        "tp2_vs_tp1_total_s": tp2["total_s_over_tp1"],
        "tp2_recv_per_rank_over_sent": min(tp2["bytes_per_rank"]) / tp2["bytes_sent"],
    }
    # Into the same TP=2 engine: each rank's own parameters (shard_direct) against the whole bucket per rank
    # (colocated); the CPU-time ratio beside the wall-time one is what the machine's cores allow.
    direct, colocated = tp2_case(tp_row, "shard_direct"), tp2_case(tp_row, "colocated")
    out["shard_direct_tp2_recv_per_rank_over_model"] = direct["recv_per_rank_over_model"]
    out["colocated_tp2_recv_per_rank_over_model"] = colocated["recv_per_rank_over_model"]
    out["shard_direct_vs_colocated_tp2_total_s"] = direct["total_s"] / colocated["total_s"]
    out["shard_direct_vs_colocated_tp2_send_s"] = direct["send_s"] / colocated["send_s"]
    out["shard_direct_vs_colocated_tp2_cpu_s"] = direct["cpu_s"] / colocated["cpu_s"]
    return out


def print_tables(result: dict) -> None:
    print(f"\nmiles_sync sync benchmark - torch {result['torch']}, ray {result['ray']}, {result['cpu_count']} cores")
    if not result["models"]:  # --parallel-only
        print_parallel_table(result["parallel"])
        return
    header = (
        f"{'model':<16}{'tensors':>8}{'MiB':>7}{'ours GB/s':>10}{'e2e GB/s':>9}{'ceiling':>8}{'vs ceil':>8}{'bound':>6}"
        f"{'per-tensor':>11}{'speedup':>8}{'ray GB/s':>9}{'coloc1':>7}{'coloc2':>7}{'pickle':>7}{'memcpy':>7}"
        f"{'pause':>7}"
    )
    print(header)
    for row in result["models"]:
        print(
            f"{row['model']:<16}{row['tensors']:>8}{row['bytes'] / MIB:>7.0f}{row['ours_send_gbps']:>10.2f}"
            f"{row['ours_end_to_end_gbps']:>9.2f}{row['ceiling_gbps']:>8.2f}{row['ratio_vs_ceiling']:>8.2f}"
            f"{row['ratio_vs_ceiling_cpu_bound']:>6.2f}"
            f"{row['per_tensor_send_gbps']:>11.2f}{row['speedup_vs_per_tensor']:>8.1f}{row['ray_gbps']:>9.2f}"
            f"{row['colocated_send_gbps']:>7.2f}{row['colocated_two_engines_send_gbps']:>7.2f}"
            f"{row['pickled_copy_gbps']:>7.2f}{row['memcpy_gbps']:>7.2f}"
            f"{row['pause_fraction_staged']:>7.2f}"
        )
    print("spread per model, median [min-max] over the repetitions:")
    for row in result["models"]:
        figures = ("ratio_vs_ceiling", "speedup_vs_per_tensor", "colocated_vs_memcpy", "pause_fraction_staged")
        spread = ", ".join(f"{k} {Spread(tuple(row['spread'][k]['values']))}" for k in figures)
        print(f"  {row['model']}: {spread}")
    sweep_row = next(r for r in result["models"] if "bucket_sweep" in r)
    print(
        f"\nbucket sweep ({sweep_row['model']}): MiB, buckets, send GB/s, sender extra MiB (x bucket), engine extra MiB"
    )
    for s in sweep_row["bucket_sweep"]:
        print(
            f"  {s['bucket_mib']:>5} {s['buckets']:>4} {s['send_gbps']:>6.2f} {s['sender_peak_extra_mib']:>8.0f} "
            f"({s['sender_extra_over_bucket']:.2f}x) {s['engine_peak_extra_mib']:>8.0f}"
        )
    print(f"engine sweep ({sweep_row['model']}): engines, send GB/s per engine, aggregate, total s")
    for s in sweep_row["engine_sweep"]:
        print(f"  {s['engines']} {s['send_gbps']:>6.2f} {s['aggregate_send_gbps']:>6.2f} {s['total_s']:>6.2f}")
    print_tp_table(sweep_row)
    largest = max(result["models"], key=lambda row: row["params"])
    print(
        f"\n{largest['model']}: share of the {result['cpu_count']} cores the sender and engines kept busy: "
        f"verified {largest['cpu_busy_verified']:.2f}, staged {largest['cpu_busy_staged']:.2f}, "
        f"colocated into one engine {largest['cpu_busy_colocated']:.2f}"
    )
    print(
        f"  a verified send needs at least the ceiling's CPU time ({largest['ceiling_cpu_s']:.2f} s over its "
        f"processes), one memcpy per engine ({largest['memcpy_gbps']:.2f} GB/s) and the sender's SHA-256 "
        f"({largest['sha256_gbps']:.2f} GB/s): on {result['cpu_count']} cores ratio_vs_ceiling <= "
        f"{largest['ratio_vs_ceiling_cpu_bound']:.2f} (measured {largest['ratio_vs_ceiling']:.2f})"
    )
    for key, where in (("engine_digests_in_pause", "in the pause"), ("engine_digests_staged", "ahead of it")):
        case = largest[key]
        print(
            f"  {ENGINES} engines answering SGLang's digests, staged, verified ({case['verification']}), layout "
            f"digests predicted {where}: stage {case['stage_s']:.2f} s, pause window {case['pause_window_s']:.2f} s "
            f"of {case['total_s']:.2f} s ({case['pause_fraction']:.2f}), cores busy {case['cpu_busy']:.2f}"
        )
    if result.get("parallel") is not None:
        print_parallel_table(result["parallel"])
    if result.get("fed") is not None:
        print_fed_table(result["fed"])
    if result.get("p2p") is not None:
        print_p2p_table(result["p2p"])


def print_tp_table(row: dict) -> None:
    print(
        f"\nTP comparison ({row['model']}, one engine fed by one source, verify off): bytes each engine rank"
        " took in per sync, counted by the engine (broadcasts received, payload tensors mapped); recv/model: the"
        " busiest rank's over the model's bytes; CPU s: the sender's and the engine's processes per sync; time"
        " ratios against the TP=1 engine"
    )
    print(
        f"  {'case':<13}{'TP':>3}{'GB/s':>7}{'send s':>8}{'total s':>8}{'sent MiB':>10}{'recv/rank MiB':>15}"
        f"{'recv/model':>11}{'CPU s':>7}{'TP/TP1 send':>12}{'TP/TP1 total':>13}"
    )
    for c in row["tp_cases"]:
        per_rank = "/".join(f"{n / MIB:.1f}" for n in c["bytes_per_rank"])
        print(
            f"  {c['transport']:<13}{c['engine_tp']:>3}{c['send_gbps']:>7.2f}{c['send_s']:>8.3f}{c['total_s']:>8.3f}"
            f"{c['bytes_sent'] / MIB:>10.1f}{per_rank:>15}{c['recv_per_rank_over_model']:>11.3f}{c['cpu_s']:>7.2f}"
            f"{c['send_s_over_tp1']:>12.2f}{c['total_s_over_tp1']:>13.2f}"
        )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = result["models"]
    sweep_row = next(r for r in rows if "bucket_sweep" in r)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    labels = [r["model"] for r in rows]
    for key, name in (
        ("ours_send_gbps", "miles_sync (send+load)"),
        ("per_tensor_send_gbps", "per-tensor"),
        ("ray_gbps", "Ray object store"),
        ("ceiling_gbps", "gloo ceiling"),
    ):
        axes[0].plot(labels, [r[key] for r in rows], marker="o", label=name)
    axes[0].set_ylabel("GB/s")
    axes[0].set_title("distributed path by model")
    axes[0].tick_params(axis="x", rotation=30)
    axes[0].legend()
    buckets = sweep_row["bucket_sweep"]
    axes[1].plot([b["bucket_mib"] for b in buckets], [b["send_gbps"] for b in buckets], marker="o", label="send GB/s")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("bucket MiB")
    twin = axes[1].twinx()
    twin.plot(
        [b["bucket_mib"] for b in buckets],
        [b["sender_peak_extra_mib"] for b in buckets],
        "r--",
        marker="s",
        label="sender peak extra MiB",
    )
    axes[1].set_title(f"bucket sweep ({sweep_row['model']})")
    axes[1].legend(loc="upper left")
    twin.legend(loc="lower right")
    engines = sweep_row["engine_sweep"]
    axes[2].plot([e["engines"] for e in engines], [e["aggregate_send_gbps"] for e in engines], marker="o")
    axes[2].set_xlabel("engines")
    axes[2].set_ylabel("aggregate GB/s delivered")
    axes[2].set_title("engine sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def headline_keys(
    rows: list[dict],
    parallel: dict | None,
    fed: dict | None,
    fp8: dict | None = None,
    lora: dict | None = None,
    guard: dict | None = None,
    p2p: dict | None = None,
) -> dict[str, float]:
    """One repetition's headline figures of the sections given: the summary keys of the models' core cases and every
    `topologies.<key>` (numbers only)."""
    out = {k: v for k, v in (summarize(rows) if rows else {}).items() if is_number(v) and k not in HOST_RATE_KEYS}
    tops = topologies(rows, parallel, fp8, lora, guard)
    if fed is not None:
        tops.update(fed_topologies(fed))
    if p2p is not None:
        tops.update(p2p_topologies(p2p))
    return out | {f"topologies.{k}": v for k, v in tops.items()}


def digest_keys(pair: dict) -> dict[str, float]:
    """One repetition's headline figures of the engine-digest pair (`engine_digests_staged`/`_in_pause`): the pause
    fraction verified on the digests SGLang's checker answers, as the sync-speed target defines it, and the pause
    window with the layout digests predicted ahead of the pause over in it."""
    staged, in_pause = pair["engine_digests_staged"], pair["engine_digests_in_pause"]
    return {
        "pause_fraction": staged["pause_fraction"],
        "topologies.staged_pause_s_digests_ahead_vs_in_pause": staged["pause_window_s"] / in_pause["pause_window_s"],
    }


def tp_keys(comparison: dict) -> dict[str, float]:
    """One repetition's headline figures of the TP comparison (`tp_cases`, `tp_memcpy_gbps`): its side-by-side
    ratios and the colocated sync into the TP=2 engine against the memcpy measured beside it."""
    colocated = tp2_case(comparison, "colocated")
    return {"colocated_vs_memcpy_tp2": colocated["send_gbps"] / comparison["tp_memcpy_gbps"]} | {
        f"topologies.{k}": v for k, v in tp_topologies(comparison).items()
    }


def section_repetitions(
    rows: list[dict],
    parallel: dict | None,
    fed: dict | None,
    fp8: dict | None = None,
    lora: dict | None = None,
    guard: dict | None = None,
    p2p: dict | None = None,
) -> dict[str, list[dict[str, float]]]:
    """Each section's headline figures, one dict per repetition of that section (sections take different numbers
    of repetitions: LAYOUT_REPETITIONS); `rows` are the models' rows, whose core cases, engine-digest pair (the
    largest model's) and TP comparison (the sweep model's) are sections of their own."""
    out = {}
    if rows:
        out["models"] = [
            headline_keys([r["repetitions"][i] for r in rows], None, None) for i in range(len(rows[0]["repetitions"]))
        ]
        largest = max(rows, key=lambda row: row["params"])
        out["digests"] = [digest_keys(pair) for pair in largest["digest_repetitions"]]
        tp_row = next((r for r in rows if "tp_repetitions" in r), None)
        if tp_row is not None:
            out["tp"] = [tp_keys(comparison) for comparison in tp_row["tp_repetitions"]]
    if parallel is not None:
        out["parallel"] = [headline_keys([], p, None) for p in parallel["repetitions"]]
    if fed is not None:
        out["fed"] = [headline_keys([], None, f) for f in fed["repetitions"]]
    if p2p is not None:
        out["p2p"] = [headline_keys([], None, None, p2p=p) for p in p2p["repetitions"]]
    if fp8 is not None and lora is not None and guard is not None:
        out["fp8_lora_guard"] = [
            headline_keys([], None, None, *x)
            for x in zip(fp8["repetitions"], lora["repetitions"], guard["repetitions"], strict=True)
        ]
    return out


def with_spreads(result: dict, sections: dict[str, list[dict[str, float]]]) -> dict:
    """`result` with every headline figure set to its median over its section's repetitions (a peak, PEAK_KEYS: its
    largest), `spread` holding each one's median [min-max] and values, `unstable` the figures whose spread exceeds
    _repeat.UNSTABLE_SPREAD and `caveats` why a figure cannot be read as measured (unstable, saturated, not
    exercised)."""
    spreads = {}
    for reps in sections.values():
        spreads.update(spreads_of(reps, list(reps[0])))
    result = dict(result)
    result["topologies"] = {}
    for key, s in spreads.items():
        value = s.high if key in PEAK_KEYS else s.median
        if key.startswith("topologies."):
            result["topologies"][key.removeprefix("topologies.")] = value
        else:
            result[key] = value
    result["section_repetitions"] = {name: len(reps) for name, reps in sections.items()}
    result["repetitions"] = min(result["section_repetitions"].values())
    result["spread"] = {k: s.to_json() for k, s in spreads.items()}
    result["unstable"] = [k for k, s in spreads.items() if s.unstable]
    result["caveats"] = caveats(result, spreads)
    return result


def caveats(result: dict, spreads: dict[str, Spread]) -> dict[str, str]:
    """Why a headline figure of this run cannot be read as a measurement of what it names (reasons joined)."""
    out: dict[str, list[str]] = {}
    for key, s in spreads.items():
        if s.unstable:
            out.setdefault(key, []).append(f"spread {s.spread:.2f} (max/min over the repetitions) > {UNSTABLE_SPREAD}")
    largest = next((r for r in result.get("models", []) if r["model"] == result.get("largest_model")), None)
    if largest is not None:
        if max(spreads["ratio_vs_ceiling_cpu_bound"].values) >= 0.999:
            out.setdefault("ratio_vs_ceiling_cpu_bound", []).append(
                f"saturated at 1.0 in a repetition: the least CPU work a verified send of {largest['model']}"
                f" ({largest['bytes'] / MIB:.0f} MiB) needs, spread over {result['cpu_count']} cores, took less than"
                " the ceiling broadcast's own wall time; the cores do not bound this model's send here (a larger"
                " model's do), so read ratio_vs_ceiling alone"
            )
        if largest.get("ours_buckets") == 1:
            for key in ("ratio_vs_ceiling",):
                out.setdefault(key, []).append(
                    f"{largest['model']} fits one {DEFAULT_BUCKET // MIB} MiB bucket: packing never overlaps the"
                    " transfer, so this measures one unpipelined bucket, not the pipelined send"
                )
        if math.isnan(result.get("peak_extra_mem_over_bucket", 0.0)):
            out.setdefault("peak_extra_mem_over_bucket", []).append(
                "no swept bucket is both below the model's size and above its largest unit"
            )
    return {key: "; ".join(reasons) for key, reasons in out.items()}


def print_keys(result: dict) -> None:
    spread = result["spread"]
    per_section = ", ".join(f"{name} {n}" for name, n in result["section_repetitions"].items())
    print(f"\nkeys: median [min-max] over alternating repetitions ({per_section}; commit {result['commit']})")
    for key, s in spread.items():
        if not key.startswith("topologies."):
            peak = f" (a peak: the figure is the max, {s['max']:.3f})" if key in PEAK_KEYS else ""
            print(f"  {key} = {Spread(tuple(s['values']))}{peak}")
    print("topologies side by side:")
    for key, s in spread.items():
        if key.startswith("topologies."):
            print(f"  {key.removeprefix('topologies.')} = {Spread(tuple(s['values']))}")
    rates = ", ".join(f"{key} = {result[key]:.3f}" for key in sorted(HOST_RATE_KEYS) if is_number(result.get(key)))
    if rates:
        print(f"host rates (absolute, they follow the host's speed: no headline key; see HOST_RATE_KEYS): {rates}")
    if result["caveats"]:
        print("caveats (figures this run cannot measure well):")
        for key, why in result["caveats"].items():
            print(f"  {key}: {why}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="models up to ~100M, bucket sweep to 256 MiB")
    parser.add_argument("--parallel-only", action="store_true", help="only the pipeline/expert-parallel section")
    parser.add_argument(
        "--tp-only", action="store_true", help="only the TP comparison (TP=1 vs TP=2 engine, each transport)"
    )
    parser.add_argument(
        "--p2p-only", action="store_true", help="only p2p against the distributed broadcast (engines on their own)"
    )
    parser.add_argument("--json", type=Path, default=None, help="default outputs/bench_sync[_parallel].json")
    parser.add_argument("--png", type=Path, default=Path("outputs/bench_sync.png"))
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("MILES_SYNC_CACHE", "~/.cache/miles_sync")))
    parser.add_argument("--log-dir", type=Path, default=Path("outputs/bench_sync_logs"))
    parser.add_argument(
        "--repetitions",
        type=int,
        default=LAYOUT_REPETITIONS,
        help=f"alternating repetitions every figure is the median of (default {LAYOUT_REPETITIONS}, least "
        f"{MIN_REPETITIONS}; the layout sections and per-model pairs never take fewer than {LAYOUT_REPETITIONS})",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="measured syncs per series after its warm-up, their median the series' figure (default: 3 for models"
        " below 256 MiB and the layout sections, 1 above)",
    )
    parser.add_argument("--models", default=None, help="comma-separated subset of " + ",".join(MODELS))
    parser.add_argument(
        "--models-only",
        action="store_true",
        help="only the per-model section (no parallel layouts, fed engines, FP8, LoRA or draft guard)",
    )
    parser.add_argument(
        "--compare",
        metavar="COMMIT",
        default=None,
        help="run this benchmark (with the other options given) from a checkout of COMMIT and from this one, "
        "alternating, and print each key's ratio (benchmarks/bench_compare.py)",
    )
    args = parser.parse_args(argv)
    if args.compare is not None:
        return compare_main(args.compare, list(sys.argv[1:] if argv is None else argv))
    if args.repetitions < MIN_REPETITIONS:
        parser.error(f"--repetitions must be >= {MIN_REPETITIONS}: a median of fewer is one sample's luck")
    args.cache = args.cache.expanduser()
    if args.json is None:
        kind = "_parallel" if args.parallel_only else "_tp" if args.tp_only else "_p2p" if args.p2p_only else ""
        args.json = Path(f"outputs/bench_sync{kind}.json")
    names = args.models.split(",") if args.models else list(QUICK_MODELS if args.quick else FULL_MODELS)
    args.bucket_sweep = [16, 64, 256] if args.quick else [16, 64, 256, 1024]
    torch.set_num_threads(1)  # as every engine runs; the sender's copies and hashes run on their own threads
    adopt_bind_host(HOST)  # every group of this process and its children binds loopback

    import ray

    from launch.cluster import connect_ray
    from miles_sync.config import ClusterConfig

    started = time.perf_counter()
    reps = args.repetitions
    layout_reps = max(reps, LAYOUT_REPETITIONS)
    small = args.repeats or SMALL_SERIES_SYNCS  # the layout sections' models are all below 256 MiB
    # The fed and p2p cases, as the full run and --tp-only / --p2p-only run them: FED_REPETITIONS of FED_SERIES_SYNCS.
    short_sync_args = {
        "cache": args.cache,
        "log_dir": args.log_dir,
        "repeats": max(layout_reps, FED_REPETITIONS),
        "syncs": max(small, FED_SERIES_SYNCS),
        "bucket_bytes": DEFAULT_BUCKET,
    }
    fed_section = functools.partial(bench_fed, **short_sync_args)
    p2p_section = functools.partial(bench_p2p, **short_sync_args)
    sweep_model = max(names, key=lambda n: model_size(MODELS[n]))
    if args.p2p_only:
        with connect_ray(ClusterConfig(num_cpus=ENGINES + 1)):
            p2p = p2p_section()
        result = {
            "p2p_only": True,
            "wall_s": time.perf_counter() - started,
            "cpu_count": os.cpu_count(),
            "commit": git_commit(),
            "p2p": p2p,
        }
        result = with_spreads(result, {"p2p": section_repetitions([], None, None, p2p=p2p)["p2p"]})
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print_p2p_table(p2p)
        print_keys(result)
        print(f"\nwrote {args.json} in {result['wall_s']:.0f} s")
        return 0
    if args.tp_only:
        with connect_ray(ClusterConfig(num_cpus=ENGINES + 1)):
            row = bench_tp_only(MODELS[sweep_model], args)
            fed = fed_section()
        result = {
            "tp_only": True,
            "repeats": args.repeats,
            "wall_s": time.perf_counter() - started,
            "cpu_count": os.cpu_count(),
            "commit": git_commit(),
            "models": [row],
            "fed": fed,
        }
        sections = {
            "tp": [tp_keys(comparison) for comparison in row["tp_repetitions"]],
            "fed": section_repetitions([], None, fed)["fed"],
        }
        result = with_spreads(result, sections)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print_tp_table(row)
        print_fed_table(fed)
        print_keys(result)
        print(f"\nwrote {args.json} in {result['wall_s']:.0f} s")
        return 0
    with connect_ray(ClusterConfig(num_cpus=ENGINES + 1)):
        rows = (
            [] if args.parallel_only else [bench_model(MODELS[n], args, is_sweep_model=n == sweep_model) for n in names]
        )
        parallel = (
            None
            if args.models_only
            else bench_parallel(
                quick=args.quick,
                cache=args.cache,
                log_dir=args.log_dir,
                repeats=small,
                repetitions=layout_reps,
                bucket_bytes=DEFAULT_BUCKET,
            )
        )
        fed = None if args.parallel_only or args.models_only else fed_section()
        p2p = None if args.parallel_only or args.models_only else p2p_section()
    fp8 = lora = guard = None
    if not (args.parallel_only or args.models_only):
        smallest = min(names, key=lambda n: model_size(MODELS[n]))
        log(f"{smallest}: FP8 vs BF16, LoRA vs full, draft guard (frozen MTP draft); {layout_reps} repetitions")
        settings = dict(cache=args.cache, repeats=small, log_dir=args.log_dir)
        side = alternate(
            [
                ("FP8 vs BF16", lambda: bench_fp8_model(smallest, block=128, **settings)),
                ("LoRA vs full", lambda: bench_lora_model(smallest, rank=16, **settings)),
                ("draft guard", lambda: bench_draft_guard_model(smallest, **settings)),
            ],
            repetitions=layout_reps,
            log=log,
        )
        fp8, lora, guard = (
            median_of(runs) | {"repetitions": runs}
            for runs in (side["FP8 vs BF16"], side["LoRA vs full"], side["draft guard"])
        )
    result = {
        **(summarize(rows) if rows else {}),
        "quick": args.quick,
        "repeats": args.repeats,
        "wall_s": time.perf_counter() - started,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "commit": git_commit(),
        "models": rows,
        "parallel": parallel,
        "fp8": fp8,
        "lora": lora,
        "draft_guard": guard,
        "fed": fed,
        "p2p": p2p,
    }
    result = with_spreads(result, section_repetitions(rows, parallel, fed, fp8, lora, guard, p2p))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    if rows:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.png)
    print_tables(result)
    print_keys(result)
    print(f"\nwrote {args.json}{'' if not rows else f' and {args.png}'} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
