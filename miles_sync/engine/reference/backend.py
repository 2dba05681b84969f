"""Where a reference engine's weights live: in this process (TP=1, `LocalBackend`) or in TP rank processes
(`miles_sync.engine.reference.ranks.RankBackend`). The engine's session state machine (`engine.py`) validates a
payload against full HF metadata, then drives one backend through the same steps either way:

    receive (distributed) or decode (colocated) -> staged payload -> load into the selected runners -> finalize

A backend never validates names or selectors (the engine did) and never resumes generation. Every blocking step
is bounded by the backend's collective timeout.

A `direct` tensor update (SGLang's `_model_load_weights_direct`) takes its own path: each TP rank decodes ITS OWN
payload of (engine parameter name, local tensor) pairs and every selected runner checks it against its own
parameters (`stage_direct`), then writes the bytes as they are (`load_direct`); no finalize ever touches them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from miles_sync.engine.reference.custom_loader import run_custom_loader
from miles_sync.engine.reference.groups import UpdateGroups
from miles_sync.engine.reference.runner_api import StoredRunner
from miles_sync.engine.reference.weights_checker import WeightsChecker
from miles_sync.weights.checksum import TensorHash
from miles_sync.wire.bucket import BucketEntry, TensorMeta, unpack_bucket
from miles_sync.wire.payload import decode_payload
from miles_sync.wire.protocol import ChecksumNames, Role, WeightsCheckerRequest, WeightsCheckerResult

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

SOURCE_RANK = 0  # the trainer's source rank in every update group
_MAX_TENSOR_BYTES = 2**63 - 1  # torch sizes are int64


class EngineDown(RuntimeError):
    """The engine's TP ranks are gone (one died or stopped answering): it refuses everything but health reads."""


class EngineCrashed(EngineDown):
    """A request SGLang's scheduler dies on (a direct load naming a tensor the runner has no parameter for, or of
    another shape): SGLang's whole server exits without answering it, so this engine stops serving too."""


class AllocationError(Exception):
    """The receive buffer a payload claims cannot be allocated; raised before anything is received."""


def allocate(make: Callable[[], torch.Tensor], num_bytes: int) -> torch.Tensor:
    """`make()`, with a claimed size past int64 or the host's memory reported as a refusal, not a crash (torch
    raises TypeError, RuntimeError or MemoryError, depending on how far past)."""
    if num_bytes > _MAX_TENSOR_BYTES:
        raise AllocationError(f"the payload claims {num_bytes} bytes, more than a tensor can hold (2**63 - 1)")
    try:
        return make()
    except (TypeError, OverflowError, MemoryError, RuntimeError) as exc:
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]  # torch appends a C++ trace to some
        raise AllocationError(f"cannot allocate the {num_bytes} bytes the payload claims: {first_line}") from None


def join_rank_problems(*, rank_offset: int, tp_size: int, world_size: int) -> list[str]:
    """Why an engine of `tp_size` ranks cannot join at `rank_offset` (its ranks are rank_offset + tp_rank)."""
    first, last = rank_offset, rank_offset + tp_size - 1
    if first <= SOURCE_RANK or last >= world_size:
        return [
            f"engine ranks {first}..{last} (rank_offset {rank_offset} + tp_rank 0..{tp_size - 1}) must lie in "
            f"1..{world_size - 1}: rank {SOURCE_RANK} is the trainer's source"
        ]
    return []


class WeightBackend(Protocol):
    """The weight-side operations the engine's state machine drives (see the module docstring)."""

    tp_size: int
    checksum_names: ChecksumNames
    tensor_hash: TensorHash
    failure: str | None  # why the weights can no longer be served (a rank process died), None while healthy
    rank_pids: tuple[int | None, ...]  # the TP rank processes, empty when the weights live in the engine's own

    def join_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> str: ...
    def destroy_group(self, group_name: str) -> None: ...
    def receive(self, group_name: str, entries: Sequence[BucketEntry], *, is_bucket: bool) -> Any: ...
    def decode(self, payloads: Sequence[str], *, load_format: str | None) -> tuple[Any, list[TensorMeta]]: ...
    def load(self, runners: Sequence[Any], staged: Any) -> dict[str, int]: ...
    def stage_direct(self, runners: Sequence[Any], payloads: Sequence[str]) -> Any: ...
    def received_bytes(self) -> tuple[int, ...]: ...
    def load_direct(self, runners: Sequence[Any], staged: Any) -> dict[str, int]: ...
    def load_custom(self, runners: Sequence[Any], payloads: Sequence[str], *, path: str) -> dict[str, int]: ...
    def discard(self, staged: Any) -> None: ...
    def check(self, request: WeightsCheckerRequest, *, roles: set[Role]) -> WeightsCheckerResult: ...
    def close(self) -> None: ...


class LocalBackend:
    """TP=1: the runners live in this process; a staged payload is the received (name, tensor) list."""

    tp_size = 1  # payloads per colocated update
    failure: str | None = None  # in-process weights cannot fail apart from the engine
    rank_pids: tuple[int, ...] = ()  # no rank processes

    def __init__(
        self,
        runners: Mapping[Role, StoredRunner],
        *,
        timeout_s: float,
        checksum_names: ChecksumNames = ChecksumNames.HF,
        draft_role: str = Role.DRAFT.value,
        tp_rank: int = 0,
        tp_size: int = 1,
        tensor_hash: TensorHash = TensorHash.SHA256,
    ) -> None:
        """`tp_rank`/`tp_size`: where these runners sit in their engine, as the checker reports it (a rank process
        of a multi-rank engine drives its own slice through a LocalBackend; it still decodes one payload)."""
        self._timeout_s = timeout_s
        self._groups = UpdateGroups(timeout_s=timeout_s)
        self._checker = WeightsChecker(
            runners,
            checksum_names=checksum_names,
            draft_role=draft_role,
            tp_rank=tp_rank,
            tp_size=tp_size,
            tensor_hash=tensor_hash,
        )
        self._receive_buffer: torch.Tensor | None = None  # see _bucket_buffer
        self._received_bytes = 0

    def received_bytes(self) -> tuple[int, ...]:
        """Bytes of tensor data this rank took in since start (broadcasts received, payload tensors it mapped): what
        a benchmark reads to measure how much of the model each engine rank receives."""
        return (self._received_bytes,)

    @property
    def checksum_names(self) -> ChecksumNames:
        return self._checker.checksum_names

    @property
    def tensor_hash(self) -> TensorHash:
        return self._checker.tensor_hash

    def join_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> str:
        problems = join_rank_problems(rank_offset=rank_offset, tp_size=1, world_size=world_size)
        if problems:
            raise ValueError(problems[0])
        self._groups.join(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        return f"joined {group_name!r} as rank {rank_offset}"

    def destroy_group(self, group_name: str) -> None:
        self._groups.destroy(group_name)

    def receive(self, group_name: str, entries: Sequence[BucketEntry], *, is_bucket: bool) -> list:
        """The trainer broadcasts once per bucket (flattened) or once per tensor in request order."""
        group = self._groups.get(group_name)
        try:
            if is_bucket:
                buffer = allocate(lambda: self._bucket_buffer(entries[-1].end, device=group.device), entries[-1].end)
                group.broadcast(buffer, src=SOURCE_RANK, timeout_s=self._timeout_s)
                self._received_bytes += entries[-1].end
                return unpack_bucket(buffer.cpu(), entries)
            named = []
            for entry in entries:
                tensor = allocate(
                    lambda entry=entry: torch.empty(entry.shape, dtype=entry.dtype, device=group.device),
                    entry.end - entry.start,
                )
                group.broadcast(tensor, src=SOURCE_RANK, timeout_s=self._timeout_s)
                self._received_bytes += entry.end - entry.start
                named.append((entry.name, tensor.cpu()))
            return named
        except AllocationError:
            raise
        except (TimeoutError, RuntimeError) as exc:
            raise ValueError(f"receiving failed, group {group.group_name!r} is unusable: {exc}") from None

    def _bucket_buffer(self, num_bytes: int, *, device: torch.device) -> torch.Tensor:
        """A receive buffer of `num_bytes`, reused from bucket to bucket on the CPU (a fresh one costs a page fault
        per 4 KiB and an munmap, about as long as the receive). Safe: payloads run one at a time under the engine
        lock, and `Runner.load` copies out of the buffer before the payload answers."""
        if device.type != "cpu":
            return torch.empty(num_bytes, dtype=torch.uint8, device=device)
        if self._receive_buffer is None or self._receive_buffer.numel() < num_bytes:
            self._receive_buffer = None  # free the old one before allocating the larger one
            self._receive_buffer = torch.empty(num_bytes, dtype=torch.uint8)
        return self._receive_buffer[:num_bytes]

    def decode(self, payloads: Sequence[str], *, load_format: str | None) -> tuple[list, list[TensorMeta]]:
        if len(payloads) != self.tp_size:
            raise ValueError(
                f"serialized_named_tensors has {len(payloads)} payloads; this engine runs TP={self.tp_size} and "
                f"takes exactly {self.tp_size} (one per TP rank)"
            )
        named = decode_payload(payloads[0], load_format=load_format)
        self._received_bytes += sum(t.numel() * t.element_size() for _, t in named)
        return named, [TensorMeta(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in named]

    def load(self, runners: Sequence[StoredRunner], staged: list) -> dict[str, int]:
        return {runner.role.value: len(runner.load(staged)) for runner in runners}

    def stage_direct(self, runners: Sequence[StoredRunner], payloads: Sequence[str]) -> list:
        """Decode this rank's payload and check it against every selected runner's parameters; raises ValueError
        for a payload that does not decode and EngineCrashed naming each tensor SGLang's loader would die on."""
        named, _ = self.decode(payloads, load_format="direct")
        problems = [f"{runner.role.value} runner: {p}" for runner in runners for p in runner.direct_problems(named)]
        if problems:
            raise EngineCrashed("direct load: " + "; ".join(problems))
        return named

    def load_direct(self, runners: Sequence[StoredRunner], staged: list) -> dict[str, int]:
        return {runner.role.value: len(runner.load_direct(staged)) for runner in runners}

    def load_custom(self, runners: Sequence[StoredRunner], payloads: Sequence[str], *, path: str) -> dict[str, int]:
        """Run the custom loader at `path` on this rank's payload into every runner (custom_loader); ValueError for
        a payload that does not decode, CustomLoaderFailed when the loader raises."""
        named, _ = self.decode(payloads, load_format=None)
        return {role: len(names) for role, names in run_custom_loader(path, runners, named).items()}

    def discard(self, staged: list) -> None:
        del staged  # nothing held beyond the list

    def check(self, request: WeightsCheckerRequest, *, roles: set[Role]) -> WeightsCheckerResult:
        return self._checker.handle(request, roles=roles)

    def close(self) -> None:
        self._groups.close()
