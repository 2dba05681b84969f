"""The baselines bench_sync.py measures miles_sync against, each in the same run: the bytes each TCP socket of a
process received (the kernel's tcp_info via `ss`), the ceiling (one gloo broadcast of one contiguous buffer among the
same number of processes), SHA-256 and memcpy of the same bytes, the Ray object store at its best, and a pickled
copy through a pipe into another process. After one warm-up, the baselines (Ray, the pickled copy) are a median over
`repeats` runs; what a bound is built from (the ceiling, memcpy, SHA-256) the fastest of at least BEST_OF runs."""

from __future__ import annotations

import multiprocessing
import pickle
import re
import shutil
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _sync_models import CALL_TIMEOUT_S

from miles_sync.env import LOOPBACK_HOST, adopt_bind_host
from miles_sync.transport.group import start_store_server
from miles_sync.weights.checksum import tensor_checksum

BEST_OF = 5  # runs a bound's cost is the fastest of (each a fraction of a second)


def tcp_bytes_received(pids: Sequence[int]) -> dict[tuple[int, str], int]:
    """Bytes each connected TCP socket of `pids` has received so far, keyed by (pid, local and peer address), from
    the kernel's tcp_info as `ss` prints it. Empty without pids or without `ss`."""
    if not pids or shutil.which("ss") is None:
        return {}
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True, timeout=60).stdout
    counts = {}
    for block in re.split(r"\n(?=\S)", out):  # a socket's line, then its indented tcp_info line
        received = re.search(r"\bbytes_received:(\d+)", block)  # absent while nothing was received
        owners = {int(pid) for pid in re.findall(r"\bpid=(\d+),", block)} & set(pids)
        for pid in owners:
            counts[(pid, " ".join(block.split()[3:5]))] = int(received.group(1)) if received else 0
    return counts


def received_per_pid(
    before: dict[tuple[int, str], int], after: dict[tuple[int, str], int], *, pids: Sequence[int], repeats: int
) -> dict[int, float]:
    """TCP bytes per sync each pid received between two snapshots. A socket opened in between counts from zero; one
    closed in between is lost (HTTP keep-alives at most: the update group's sockets live across the syncs)."""
    if not after:
        return {}
    return {pid: sum(n - before.get(key, 0) for key, n in after.items() if key[0] == pid) / repeats for pid in pids}


# ---- baselines outside the engines ----------------------------------------------------------------------------


def _ceiling_rank(rank: int, world_size: int, port: int, num_bytes: int, repeats: int, out) -> None:

    adopt_bind_host(LOOPBACK_HOST)  # this process's groups bind loopback (gloo's interface derived from it)
    store = dist.TCPStore(
        LOOPBACK_HOST, port, world_size, is_master=False, timeout=__import__("datetime").timedelta(seconds=300)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    buffer = torch.ones(num_bytes, dtype=torch.uint8) if rank == 0 else torch.empty(num_bytes, dtype=torch.uint8)
    times = []
    cpu_s = 0.0  # this rank's CPU time (all its threads: gloo's included) in the measured broadcasts
    for i in range(repeats + 1):  # the first one warms the connections up
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        dist.broadcast(buffer, src=0)
        dist.barrier()  # every receiver has the whole buffer
        times.append(time.perf_counter() - start)
        if i:
            cpu_s += time.process_time() - cpu_start
    out.put((rank, min(times[1:]), cpu_s / repeats))
    dist.destroy_process_group()


@dataclass(frozen=True)
class Ceiling:
    """(d): wall time of one broadcast, and the CPU time all its processes used in it (the transfer's own work)."""

    seconds: float
    cpu_s: float


def ceiling_broadcast(num_bytes: int, *, world_size: int, repeats: int) -> Ceiling:
    """(d): one gloo broadcast of `num_bytes` contiguous bytes from rank 0 to world_size - 1 processes: the fastest
    of at least BEST_OF measured broadcasts (a ceiling is the best this machine does; whatever else runs only slows
    a broadcast down, so the fastest is the figure that holds from run to run), the CPU time their mean."""
    repeats = max(repeats, BEST_OF)
    ctx = multiprocessing.get_context("spawn")
    store = start_store_server(host=LOOPBACK_HOST, timeout_s=300.0)  # listens on loopback only; outlives the ranks
    out = ctx.Queue()
    ranks = [
        ctx.Process(target=_ceiling_rank, args=(r, world_size, store.port, num_bytes, repeats, out))
        for r in range(world_size)
    ]
    for p in ranks:
        p.start()
    try:
        answers = {rank: (wall_s, cpu_s) for rank, wall_s, cpu_s in (out.get(timeout=600) for _ in ranks)}
        return Ceiling(seconds=answers[0][0], cpu_s=sum(cpu_s for _, cpu_s in answers.values()))
    finally:
        for p in ranks:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        del store


def sha256_seconds(tensors: dict[str, torch.Tensor], *, repeats: int) -> float:
    """The sender's verification hash of every tensor (SHA-256, SGLang's checker digest), in this process."""

    def hash_all() -> None:
        for t in tensors.values():
            tensor_checksum(t)

    return best_seconds(hash_all, repeats=repeats)


def verified_cpu_bound(*, ceiling: Ceiling, memcpy_s: float, sha256_s: float, engines: int, cores: int) -> float:
    """The highest `ratio_vs_ceiling` a verified sync can reach on `cores` cores: at least the ceiling's transfer
    work, one copy of the bytes into each engine's weights and one hash of them on the sender must run, so the send
    takes at least their CPU time over the cores. Measured costs of the same run; the sender's packing, the HTTP
    requests and the engines' unpacking are left out (an optimistic bound)."""
    work_s = ceiling.cpu_s + engines * memcpy_s + sha256_s
    return ceiling.seconds / max(ceiling.seconds, work_s / cores)


def ray_object_store_seconds(tensors: dict[str, torch.Tensor], *, num_engines: int, repeats: int) -> float:
    """(c): put the state dict once (numpy views of the bytes), every actor gets it zero-copy and copies it into
    its preallocated tensors; wall time from the put to the last actor done."""
    import ray

    @ray.remote(num_cpus=0)
    class Receiver:
        def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
            self._tensors = {n: torch.empty(s, dtype=d) for n, (s, d) in shapes.items()}

        def load(self, refs: list) -> int:
            arrays = ray.get(refs[0], timeout=CALL_TIMEOUT_S)
            for name, array in arrays.items():
                target = self._tensors[name]
                target.view(-1).view(torch.uint8).copy_(torch.from_numpy(array))
            return len(arrays)

    shapes = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    receivers = [Receiver.remote(shapes) for _ in range(num_engines)]
    ray.get([r.load.remote([ray.put({})]) for r in receivers], timeout=CALL_TIMEOUT_S)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        ref = ray.put({n: t.reshape(-1).view(torch.uint8).numpy() for n, t in tensors.items()})
        ray.get([r.load.remote([ref]) for r in receivers], timeout=CALL_TIMEOUT_S)
        times.append(time.perf_counter() - start)
        del ref
    for r in receivers:
        ray.kill(r)
    return statistics.median(times[1:])


def _pickle_receiver(conn, shapes) -> None:
    # The unpickled bytes are read-only and are only read from here: torch's warning about that does not apply.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    tensors = {n: torch.empty(s, dtype=d) for n, (s, d) in shapes.items()}
    while (payload := conn.recv_bytes()) != b"":
        for name, raw in pickle.loads(payload).items():
            tensors[name].view(-1).view(torch.uint8).copy_(torch.frombuffer(raw, dtype=torch.uint8))
        conn.send_bytes(b"ok")


def pickled_copy_seconds(tensors: dict[str, torch.Tensor], *, repeats: int) -> float:
    """Colocated baseline: the state dict pickled by value, through a pipe, unpickled and loaded in another process."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    receiver = ctx.Process(target=_pickle_receiver, args=(child, shapes))
    receiver.start()
    times = []
    try:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            parent.send_bytes(
                pickle.dumps(
                    {n: t.reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}, protocol=5
                )
            )
            if not parent.poll(CALL_TIMEOUT_S):
                raise TimeoutError("pickled-copy receiver did not answer")
            parent.recv_bytes()
            times.append(time.perf_counter() - start)
        parent.send_bytes(b"")
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    return statistics.median(times[1:])


def memcpy_seconds(tensors: dict[str, torch.Tensor], *, repeats: int) -> float:
    """One copy of every tensor's bytes into a preallocated buffer, in this process."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    out = torch.empty(total, dtype=torch.uint8)
    out.fill_(0)
    return best_seconds(lambda: copy_into(out, tensors), repeats=repeats)


def copy_into(out: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor's bytes into `out` (uint8, at least their total size), back to back in dict order."""
    offset = 0
    for t in tensors.values():
        raw = t.reshape(-1).view(torch.uint8)
        out[offset : offset + raw.numel()].copy_(raw)
        offset += raw.numel()


def best_seconds(work: Callable[[], object], *, repeats: int) -> float:
    """Fastest wall time of at least BEST_OF calls of `work` after one warm-up call: for the costs a bound is built
    from (memcpy, hashing), whose least time is what the machine can do."""
    return min(_timed(work, runs=max(repeats, BEST_OF)))


def median_seconds(work: Callable[[], object], *, repeats: int) -> float:
    """Median wall time of `repeats` calls of `work` after one warm-up call."""
    return statistics.median(_timed(work, runs=repeats))


def _timed(work: Callable[[], object], *, runs: int) -> list[float]:
    """Wall times of `runs` calls of `work`, after one warm-up call that is not timed."""
    work()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return times
