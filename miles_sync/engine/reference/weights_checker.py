"""`/weights_checker` of the reference engine: snapshot, reset_tensors, compare and checksum over selected runners.

- checksum: per TP rank (one here), the checksum of every selected tensor in its LOGICAL layout (a shuffled weight
  is hashed after undoing the shuffle), so the numbers equal a trainer's checksums of the HF tensors it sent;
  draft-role names carry the prefix "draft.".
- snapshot / compare: a copy of the PHYSICAL stored bytes, and a bitwise comparison against it later (or a
  tolerance comparison with allow_quant_error).
- reset_tensors: overwrite every selected tensor with random values, so that a following update must rewrite all
  of them for compare to pass (the caller marks the engine stale: random weights must not serve).
`skip_tensor_list` holds substrings of HF names (without the "draft." prefix) to leave out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from miles_sync.checksum import engine_digest, role_checksums
from miles_sync.engine.reference.runner import Runner
from miles_sync.layout import unshuffle_weight
from miles_sync.protocol import (
    ParallelismInfo,
    RankChecksums,
    Role,
    WeightsCheckerAction,
    WeightsCheckerRequest,
    WeightsCheckerResult,
)

__all__ = ["WeightsChecker"]

_QUANT_RTOL = 1e-2  # allow_quant_error: the tolerance of a round trip through an 8-bit format
_QUANT_ATOL = 1e-2
_MAX_NAMES_SHOWN = 8
_RESET_SEED = 0


class WeightsChecker:
    """Stateful (it keeps the last snapshot). The caller serializes calls with weight updates."""

    def __init__(self, runners: Mapping[Role, Runner]) -> None:
        self._runners = runners
        self._snapshot: dict[tuple[Role, str], torch.Tensor] | None = None

    def handle(
        self, request: WeightsCheckerRequest, *, roles: set[Role], is_session_open: bool
    ) -> WeightsCheckerResult:
        """Run one action over the runners of `roles`; raises ValueError when it fails (compare mismatch, ...)."""
        skip = () if request.skip_tensor_list is None else tuple(request.skip_tensor_list)
        action = request.action
        if action is WeightsCheckerAction.CHECKSUM:
            return self._checksum(roles, skip)
        if action is WeightsCheckerAction.SNAPSHOT:
            self._snapshot = {(role, name): tensor.clone() for role, name, tensor in self._stored(roles, skip)}
            return WeightsCheckerResult(success=True, message=f"snapshot of {len(self._snapshot)} tensor(s)")
        if action is WeightsCheckerAction.COMPARE:
            return self._compare(roles, skip, allow_quant_error=request.allow_quant_error)
        if is_session_open:
            raise ValueError("reset_tensors is refused while a weight update session is open")
        return self._reset(roles, skip)

    def _selected(self, roles: set[Role], skip: tuple[str, ...]) -> Iterator[tuple[Runner, list[str]]]:
        for role in (Role.TARGET, Role.DRAFT):
            runner = self._runners.get(role)
            if runner is not None and role in roles:
                yield runner, sorted(n for n in runner.owned_names() if not any(s in n for s in skip))

    def _stored(self, roles: set[Role], skip: tuple[str, ...]) -> Iterator[tuple[Role, str, torch.Tensor]]:
        for runner, names in self._selected(roles, skip):
            with runner.weights_lock:
                stored = runner.stored_tensors()
                for name in names:
                    yield runner.role, name, stored[name]

    def _checksum(self, roles: set[Role], skip: tuple[str, ...]) -> WeightsCheckerResult:
        checksums: dict[str, str] = {}
        infos = []
        for runner, names in self._selected(roles, skip):
            with runner.weights_lock:
                checksums.update(role_checksums(_logical(runner, names), role=runner.role.value))
            infos.append(
                ParallelismInfo(
                    role=runner.role, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1
                )
            )
        digest = engine_digest(checksums)
        rank = RankChecksums(checksums=checksums, per_gpu_checksum=digest, parallelism_info=tuple(infos))
        return WeightsCheckerResult(
            success=True, message=f"checksums of {len(checksums)} tensor(s)", ranks=(rank,), per_engine_checksum=digest
        )

    def _compare(self, roles: set[Role], skip: tuple[str, ...], *, allow_quant_error: bool) -> WeightsCheckerResult:
        if self._snapshot is None:
            raise ValueError("compare needs a snapshot: call weights_checker with action 'snapshot' first")
        differing, missing = [], []
        num_compared = 0
        for role, name, tensor in self._stored(roles, skip):
            before = self._snapshot.get((role, name))
            if before is None:
                missing.append(f"{role.value}:{name}")
                continue
            num_compared += 1
            if not _equal(before, tensor, allow_quant_error=allow_quant_error):
                differing.append(f"{role.value}:{name}")
        if differing or missing:
            raise ValueError(
                f"weights differ from the snapshot: {len(differing)} differing {_shown(differing)}, "
                f"{len(missing)} not in the snapshot {_shown(missing)}"
            )
        return WeightsCheckerResult(success=True, message=f"{num_compared} tensor(s) equal the snapshot")

    def _reset(self, roles: set[Role], skip: tuple[str, ...]) -> WeightsCheckerResult:
        generator = torch.Generator().manual_seed(_RESET_SEED)
        num_reset = 0
        for runner, names in self._selected(roles, skip):
            stored = runner.stored_tensors()
            runner.load([(name, _random_like(stored[name], generator)) for name in names])
            # Post-process the random bytes like any fresh load, so stored layout and compute view agree.
            runner.finalize(names)
            runner.reset_session()
            num_reset += len(names)
        return WeightsCheckerResult(success=True, message=f"reset {num_reset} tensor(s) to random values")


def _logical(runner: Runner, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stored tensors with the layout undone; bytes loaded in an open session are not shuffled yet."""
    stored = runner.stored_tensors()
    shuffled = runner.shuffled_names() - runner.loaded_in_session()
    for name in names:
        yield name, (unshuffle_weight(stored[name]) if name in shuffled else stored[name])


def _equal(a: torch.Tensor, b: torch.Tensor, *, allow_quant_error: bool) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if allow_quant_error and a.is_floating_point():
        return torch.allclose(a.float(), b.float(), rtol=_QUANT_RTOL, atol=_QUANT_ATOL)
    # Bitwise: NaN payloads and -0.0 count as differences, as they would in a kernel.
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _random_like(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if t.is_floating_point():
        return torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.randint(0, 2, t.shape, generator=generator).bool()
    return torch.randint(0, 100, t.shape, generator=generator).to(t.dtype)


def _shown(names: list[str]) -> str:
    more = len(names) - _MAX_NAMES_SHOWN
    return str(names[:_MAX_NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")
