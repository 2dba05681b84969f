"""The front of a multi-rank reference engine: it starts one process per TP rank (`rank_worker.py`) and drives
them as one engine, the way SGLang's tokenizer manager drives its TP schedulers.

- `RankFleet`: the processes, their pipes (one per channel: compute, control, group), fan-out calls with a
  deadline, and a watchdog. When any rank dies or misses a deadline the engine is down as a whole: the remaining
  ranks are stopped, `failure` says why, and every later call is refused. Nothing is ever written to the weights
  to mark it, and a front whose ranks are gone never serves again.
- `RankBackend`: the `WeightBackend` the engine's state machine drives: every rank joins an update group at
  rank_offset + tp_rank, receives every broadcast bucket and keeps its slice; a colocated update carries one
  payload per rank (the same full HF tensors, or for a direct load rank i's own engine-named shards in payload i);
  the checker answers one `RankChecksums` per rank.
- `RankRunnerView` / `RankModel`: what the scheduler and proposers see of a runner: full HF metadata, a weights
  lock and epoch kept by the front, and a model whose forward runs on every rank (rank 0's output answers).

Weight writes (load, finalize, reset) happen under the front's weights lock, which the scheduler holds for every
forward step, so no forward ever sees some ranks before a write and others after it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from miles_sync.engine.reference.backend import EngineCrashed, EngineDown, join_rank_problems
from miles_sync.engine.reference.custom_loader import CustomLoaderFailed
from miles_sync.engine.reference.models import LMOutput
from miles_sync.engine.reference.rank_worker import CHANNELS, RankArgs, rank_main
from miles_sync.engine.reference.runner_api import ServedRunner
from miles_sync.transport.group import start_store_server
from miles_sync.weights.checksum import TensorHash, sglang_parameter_names
from miles_sync.wire.bucket import BucketEntry, TensorMeta
from miles_sync.wire.dtypes import dtype_from_name
from miles_sync.wire.protocol import (
    ChecksumNames,
    RankChecksums,
    Role,
    WeightsCheckerAction,
    WeightsCheckerRequest,
    WeightsCheckerResult,
)

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

logger = logging.getLogger(__name__)

_DEADLINE_MARGIN_S = 30.0  # past the collective timeout a rank applies itself: its answer is overdue
_START_TIMEOUT_S = 600.0  # loading and sharding a checkpoint
_WATCH_INTERVAL_S = 0.5
_EXIT_POLL_S = 0.02


def wait_exited(process: multiprocessing.process.BaseProcess, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `process` to exit; True once it has. Polls its exit status (waitpid), never its
    sentinel: a child that used torch's file_system shared memory may have started torch_shm_manager, which inherits
    the child's end of the sentinel pipe and outlives it, so `join(timeout)` would wait the whole timeout for a
    process that exited at once (in the multiproc tier, test senders' stops took their full join timeout, 10 s)."""
    deadline = time.monotonic() + timeout_s
    while process.is_alive():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_EXIT_POLL_S)
    return True


@dataclass(frozen=True, kw_only=True)
class _RankProcess:
    tp_rank: int
    process: multiprocessing.process.BaseProcess
    conns: Mapping[str, Connection]


class RankFleet:
    """The rank processes of one engine; thread-safe (one lock per channel)."""

    def __init__(self, ranks: Sequence[_RankProcess], *, timeout_s: float, store: Any) -> None:
        self._ranks = tuple(ranks)
        self._timeout_s = timeout_s
        self._store = store  # the internal group's rendezvous store lives as long as the ranks
        self._locks = {name: threading.Lock() for name in CHANNELS}
        self._state_lock = threading.Lock()
        self._failure: str | None = None
        self._closing = False
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def tp_size(self) -> int:
        return len(self._ranks)

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def pids(self) -> tuple[int | None, ...]:
        return tuple(rank.process.pid for rank in self._ranks)

    def call(self, channel: str, op: str, *, per_rank: Sequence[Mapping[str, Any]] | None = None, **kwargs) -> list:
        """Run `op` on every rank (kwargs, or per_rank[r] for rank r) and return their values in rank order.

        A refusal on any rank raises ValueError naming the ranks (after every rank answered, so the channel stays
        in step); a dead rank or a missed deadline takes the engine down and raises EngineDown.
        """
        with self._locks[channel]:
            self._raise_if_down()
            sent = []
            try:
                for rank in self._ranks:
                    rank.conns[channel].send((op, dict(kwargs if per_rank is None else per_rank[rank.tp_rank])))
                    sent.append(rank)
            except (BrokenPipeError, OSError) as exc:
                self._take_down(f"TP rank {len(sent)} is unreachable ({exc})")
                self._raise_if_down()
            deadline = time.monotonic() + self._timeout_s + _DEADLINE_MARGIN_S
            replies = [self._reply(rank, channel, op, deadline) for rank in self._ranks]
        errors = [(r, reply) for r, reply in enumerate(replies) if reply[0] != "ok"]
        if errors:
            kinds = {reply[1] for _, reply in errors}
            message = "; ".join(f"TP rank {r}: {reply[2]}" for r, reply in errors)
            if "fault" in kinds:
                raise RuntimeError(message)
            if kinds == {"timeout"}:
                raise TimeoutError(message)
            raise ValueError(message)
        return [reply[1] for reply in replies]

    def _reply(self, rank: _RankProcess, channel: str, op: str, deadline: float) -> tuple:
        conn = rank.conns[channel]
        try:
            if conn.poll(max(0.0, deadline - time.monotonic())):
                return conn.recv()
        except (EOFError, OSError):
            self._take_down(self._exit_reason(rank))
            self._raise_if_down()
        self._take_down(f"TP rank {rank.tp_rank} did not answer {channel} op {op!r} in time")
        self._raise_if_down()
        raise AssertionError("unreachable")

    def _raise_if_down(self) -> None:
        if self._failure is not None:
            raise EngineDown(f"the engine is down: {self._failure}")

    def _exit_reason(self, rank: _RankProcess) -> str:
        wait_exited(rank.process, 2.0)
        code = rank.process.exitcode
        return f"TP rank {rank.tp_rank} (pid {rank.process.pid}) exited" + ("" if code is None else f" with {code}")

    def _take_down(self, reason: str) -> None:
        with self._state_lock:
            if self._failure is not None or self._closing:
                return
            self._failure = reason
        logger.error("engine down: %s; stopping every TP rank", reason)
        self._stop_processes()

    def _watch(self) -> None:
        sentinels = {rank.process.sentinel: rank for rank in self._ranks}
        while not self._closing and self._failure is None:
            ready = multiprocessing.connection.wait(list(sentinels), timeout=_WATCH_INTERVAL_S)
            # The exit status too: a sentinel that torch_shm_manager holds open (`wait_exited`) never becomes ready.
            gone = [sentinels[s] for s in ready] or [rank for rank in self._ranks if not rank.process.is_alive()]
            if gone and not self._closing:
                self._take_down(self._exit_reason(gone[0]))

    def _stop_processes(self) -> None:
        for rank in self._ranks:
            for conn in rank.conns.values():
                conn.close()
        for rank in self._ranks:
            if not wait_exited(rank.process, 5.0):
                rank.process.kill()
                wait_exited(rank.process, 5.0)

    def close(self) -> None:
        with self._state_lock:
            self._closing = True
        self._stop_processes()


def start_rank_engine(
    *,
    tp_size: int,
    host: str,
    model_path: str,
    draft_kind: str,
    draft_path: str | None,
    weight_layout: Any,
    draft_role: str,
    collective_timeout_s: float,
    num_threads: int | None,
    lora: Any = None,
    tensor_hash: TensorHash = TensorHash.SHA256,
) -> tuple[RankFleet, dict[str, Any]]:
    """Start the rank processes and wait until every rank loaded its shards; returns the fleet and rank 0's
    metadata (the full HF names, shapes and dtypes per role). Raises ValueError naming the refusal of any rank
    (e.g. a dimension the TP size does not divide) after stopping them all."""
    context = multiprocessing.get_context("spawn")
    store = start_store_server(host=host, timeout_s=collective_timeout_s)
    ranks = []
    for tp_rank in range(tp_size):
        pipes = {name: context.Pipe(duplex=True) for name in CHANNELS}
        args = RankArgs(
            tp_rank=tp_rank,
            tp_size=tp_size,
            store_host=host,
            store_port=store.port,
            model_path=model_path,
            draft_kind=draft_kind,
            draft_path=draft_path,
            weight_layout=weight_layout,
            draft_role=draft_role,
            collective_timeout_s=collective_timeout_s,
            num_threads=num_threads,
            lora=lora,
            tensor_hash=TensorHash(tensor_hash),
        )
        child_ends = {name: child for name, (_, child) in pipes.items()}
        process = context.Process(target=rank_main, args=(args, child_ends), name=f"tp-rank-{tp_rank}", daemon=True)
        process.start()
        for child in child_ends.values():
            child.close()  # the child holds its own copies: EOF on ours means it died
        ranks.append(_RankProcess(tp_rank=tp_rank, process=process, conns={n: p for n, (p, _) in pipes.items()}))
    replies, problems = [], []
    deadline = time.monotonic() + _START_TIMEOUT_S
    for rank in ranks:
        conn = rank.conns["control"]
        try:
            reply = conn.recv() if conn.poll(max(0.0, deadline - time.monotonic())) else None
        except (EOFError, OSError):
            reply = None
        if reply is None:
            problems.append(f"TP rank {rank.tp_rank} did not start (exit code {rank.process.exitcode})")
        elif reply[0] != "ok":
            problems.append(f"TP rank {rank.tp_rank}: {reply[2]}")
        replies.append(reply)
    if problems:
        for rank in ranks:
            for conn in rank.conns.values():
                conn.close()
            if not wait_exited(rank.process, 5.0):
                rank.process.kill()
        raise ValueError(f"cannot start a TP={tp_size} engine: " + "; ".join(problems))
    return RankFleet(ranks, timeout_s=collective_timeout_s, store=store), replies[0][1]


class RankModel:
    """A runner's model as the scheduler calls it: every rank runs the forward, rank 0's output answers."""

    def __init__(self, fleet: RankFleet, *, role: Role, config: Any, is_mtp: bool) -> None:
        self._fleet = fleet
        self._role = role
        self.config = config
        self.is_mtp = is_mtp

    def shared_modules(self) -> dict[str, Any]:
        return {}  # each rank passes its own sharded embedding and lm_head to its MTP head

    def __call__(self, *inputs: torch.Tensor, **unused: Any) -> LMOutput:
        del unused  # the in-process embed_tokens / lm_head arguments of an MTP head
        if self.is_mtp:
            next_ids, hidden = inputs
            (out, *_) = self._fleet.call("compute", "mtp", next_ids=next_ids, hidden=hidden)
        else:
            (input_ids,) = inputs
            (out, *_) = self._fleet.call("compute", "forward", role=self._role.value, input_ids=input_ids)
        return out


class RankRunnerView(ServedRunner):
    """One role across every rank, as the engine and the scheduler see it (the front keeps no weights)."""

    def __init__(
        self, fleet: RankFleet, *, role: Role, config: Any, metadata: Mapping[str, Any], weights_lock: threading.RLock
    ) -> None:
        self.role = Role(role)
        self._fleet = fleet
        self.is_mtp = bool(metadata["is_mtp"])
        self._expected = {
            name: TensorMeta(name=name, shape=tuple(shape), dtype=dtype_from_name(dtype))
            for name, (shape, dtype) in metadata["tensors"].items()
        }
        self._parts = sglang_parameter_names(self._expected)
        self.model = RankModel(fleet, role=self.role, config=config, is_mtp=self.is_mtp)
        self.weights_lock = weights_lock
        self._epoch = 0
        self._loaded: set[str] = set()
        self._direct: set[str] = set()  # as each rank's runner records it (HF names)

    @property
    def weights_epoch(self) -> int:
        return self._epoch

    def owned_names(self) -> frozenset[str]:
        return frozenset(self._expected)

    def expected(self, name: str) -> TensorMeta:
        meta = self._expected.get(name)
        if meta is None:
            raise ValueError(f"{self.role} runner does not own tensor {name!r}")
        return meta

    def loaded_in_session(self) -> frozenset[str]:
        return frozenset(self._loaded)

    def loaded_direct_in_session(self) -> frozenset[str]:
        return frozenset(self._direct)

    def partially_loaded(self) -> list[str]:
        """Fused engine parameters only some of whose HF parts were loaded in this session."""
        return sorted(
            engine
            for engine, parts in self._parts.items()
            if len(parts) > 1 and 0 < sum(part in self._loaded for part in parts) < len(parts)
        )

    def mark_loaded(self, names: Sequence[str]) -> None:
        self._loaded.update(names)
        self._direct.difference_update(names)
        self._epoch += 1

    def mark_loaded_direct(self, engine_names: Sequence[str]) -> None:
        """Record a direct load of these engine parameters (every rank wrote its own shard of each)."""
        parts = {part for name in engine_names for part in self._parts[name]}
        self._direct.update(parts)
        self._loaded.difference_update(parts)
        self._epoch += 1

    def reset_session(self) -> None:
        with self.weights_lock:
            self._fleet.call("control", "reset_session", role=self.role.value)
            self._loaded.clear()
            self._direct.clear()

    def finalize(self, names: Sequence[str]) -> None:
        self._finalize(list(names))

    def finalize_all(self) -> None:
        self._finalize(None)

    def _finalize(self, names: list[str] | None) -> None:
        with self.weights_lock:
            try:
                self._fleet.call("control", "finalize", role=self.role.value, names=names)
            finally:
                self._epoch += 1

    def __repr__(self) -> str:
        return f"RankRunnerView(role={self.role.value}, tp={self._fleet.tp_size}, tensors={len(self._expected)})"


class RankBackend:
    """`WeightBackend` over a `RankFleet` (see the module docstring)."""

    checksum_names = ChecksumNames.ENGINE  # a rank holds shards: SGLang's checker names only

    def __init__(
        self, fleet: RankFleet, *, weights_lock: threading.RLock, tensor_hash: TensorHash = TensorHash.SHA256
    ) -> None:
        self._fleet = fleet
        self.tensor_hash = TensorHash(tensor_hash)  # every rank process hashes this way (RankArgs)
        self._weights_lock = weights_lock

    @property
    def tp_size(self) -> int:
        return self._fleet.tp_size

    @property
    def failure(self) -> str | None:
        return self._fleet.failure

    @property
    def rank_pids(self) -> tuple[int | None, ...]:
        return self._fleet.pids

    def join_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> str:
        problems = join_rank_problems(rank_offset=rank_offset, tp_size=self.tp_size, world_size=world_size)
        if problems:
            raise ValueError(problems[0])
        per_rank = [
            dict(
                master_address=master_address,
                master_port=master_port,
                rank_offset=rank_offset + tp_rank,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            )
            for tp_rank in range(self.tp_size)
        ]
        self._fleet.call("group", "join", per_rank=per_rank)
        return f"joined {group_name!r} as ranks {rank_offset}..{rank_offset + self.tp_size - 1}"

    def destroy_group(self, group_name: str) -> None:
        self._fleet.call("control", "destroy_group", group_name=group_name)

    def received_bytes(self) -> tuple[int, ...]:
        return tuple(self._fleet.call("control", "received_bytes"))

    def receive(self, group_name: str, entries: Sequence[BucketEntry], *, is_bucket: bool) -> str:
        self._fleet.call("control", "receive", group_name=group_name, entries=tuple(entries), is_bucket=is_bucket)
        return "staged"

    def decode(self, payloads: Sequence[str], *, load_format: str | None) -> tuple[str, list[TensorMeta]]:
        if len(payloads) != self.tp_size:
            raise ValueError(
                f"serialized_named_tensors has {len(payloads)} payloads; this engine runs TP={self.tp_size} and "
                f"takes exactly {self.tp_size} (one per TP rank, payload i for rank i)"
            )
        per_rank = [dict(payload=p, load_format=load_format) for p in payloads]
        try:
            metas = self._fleet.call("control", "decode", per_rank=per_rank)
        except ValueError:
            self.discard("staged")
            raise
        differing = [r for r, m in enumerate(metas) if m != metas[0]]
        if differing:
            self.discard("staged")
            raise ValueError(
                f"the payloads of TP ranks {differing} name other tensors, shapes or dtypes than rank 0's: every "
                f"rank receives the same full HF tensors"
            )
        return "staged", [TensorMeta(name=n, shape=tuple(s), dtype=dtype_from_name(d)) for n, s, d in metas[0]]

    def load(self, runners: Sequence[RankRunnerView], staged: str) -> dict[str, int]:
        del staged
        with self._weights_lock:
            loaded = self._fleet.call("control", "load", roles=[r.role.value for r in runners])[0]
            for runner in runners:
                runner.mark_loaded(loaded[runner.role.value])
        return {role: len(names) for role, names in loaded.items()}

    def stage_direct(self, runners: Sequence[RankRunnerView], payloads: Sequence[str]) -> str:
        """Every rank decodes payload i (its own engine-named shards; shapes may differ between ranks) and checks it
        against its runners. Raises ValueError when a payload does not decode, EngineCrashed naming each rank's
        tensors SGLang's loader would die on (any rank dying takes SGLang's whole server down)."""
        if len(payloads) != self.tp_size:
            raise ValueError(
                f"serialized_named_tensors has {len(payloads)} payloads; this engine runs TP={self.tp_size} and "
                f"takes exactly {self.tp_size} (one per TP rank, payload i for rank i)"
            )
        per_rank = [dict(payload=p, roles=[runner.role.value for runner in runners]) for p in payloads]
        try:
            fatal = self._fleet.call("control", "stage_direct", per_rank=per_rank)
        except ValueError:
            self.discard("staged")
            raise
        problems = [f"TP rank {r}: {problem}" for r, problem in enumerate(fatal) if problem is not None]
        if problems:
            self.discard("staged")
            raise EngineCrashed("; ".join(problems))
        return "staged"

    def load_direct(self, runners: Sequence[RankRunnerView], staged: str) -> dict[str, int]:
        del staged
        with self._weights_lock:
            loaded = self._fleet.call("control", "load_direct", roles=[r.role.value for r in runners])[0]
            for runner in runners:
                runner.mark_loaded_direct(loaded[runner.role.value])
        return {role: len(names) for role, names in loaded.items()}

    def load_custom(self, runners: Sequence[RankRunnerView], payloads: Sequence[str], *, path: str) -> dict[str, int]:
        """Every rank runs the custom loader at `path` on payload i, at once (a p2p loader on one rank waits for
        its own transfers only). Raises ValueError when a payload does not decode, CustomLoaderFailed naming each
        rank whose loader raised (any rank's scheduler dying takes SGLang's whole server down)."""
        if len(payloads) != self.tp_size:
            raise ValueError(
                f"serialized_named_tensors has {len(payloads)} payloads; this engine runs TP={self.tp_size} and "
                f"takes exactly {self.tp_size} (one per TP rank, payload i for rank i)"
            )
        roles = [runner.role.value for runner in runners]
        with self._weights_lock:
            results = self._fleet.call(
                "control", "load_custom", per_rank=[dict(payload=p, path=path, roles=roles) for p in payloads]
            )
            failed = [f"TP rank {r}: {result}" for r, result in enumerate(results) if isinstance(result, str)]
            written = [result for result in results if not isinstance(result, str)]
            for runner in runners:
                runner.mark_loaded_direct(sorted({n for result in written for n in result[runner.role.value]}))
        if failed:
            raise CustomLoaderFailed("; ".join(failed))
        return {role: max(len(result[role]) for result in written) for role in roles}

    def discard(self, staged: str) -> None:
        del staged
        with contextlib.suppress(EngineDown):
            self._fleet.call("control", "discard")

    def check(self, request: WeightsCheckerRequest, *, roles: set[Role]) -> WeightsCheckerResult:
        results = self._fleet.call("control", "check", request=request, roles=sorted(r.value for r in roles))
        if request.action is not WeightsCheckerAction.CHECKSUM:
            return WeightsCheckerResult(success=True, message=f"every TP rank: {results[0].message}")
        ranks: list[RankChecksums] = [rank for result in results for rank in result.ranks]
        h = hashlib.sha256()  # SGLang's per_engine_checksum: every rank's per_gpu_checksum, in rank order
        for rank in ranks:
            h.update(rank.per_gpu_checksum.encode())
        total = sum(len(rank.checksums) for rank in ranks)
        return WeightsCheckerResult(
            success=True,
            message=f"checksums of {total} tensor(s) over {len(ranks)} TP rank(s)",
            ranks=tuple(ranks),
            per_engine_checksum=h.hexdigest(),
        )

    def close(self) -> None:
        self._fleet.close()
