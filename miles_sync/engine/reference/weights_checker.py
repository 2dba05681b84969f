"""`/weights_checker` of the reference engine: snapshot, reset_tensors, compare and checksum over selected runners.

Two naming modes for checksum (`ChecksumNames`, chosen once per engine):
- hf (default): per TP rank (one here), the checksum of every selected tensor under its HF name in its LOGICAL
  layout (a shuffled weight is hashed after undoing the shuffle), `miles_sync.weights.checksum.tensor_checksum`, so the
  numbers equal a trainer's checksums of the HF tensors it sent.
- engine: what SGLang's checker answers: the engine's own parameter names (q/k/v fused into `qkv_proj`, gate/up
  into `gate_up_proj`, concatenated along dim 0), the PHYSICAL stored bytes (after post-processing), each digest
  SGLang's 16-hex-digit `tensor_hash`, and SGLang's per_gpu / per_engine digests.
Draft-role names carry the draft role's name as prefix ("draft." or "draft_step_0."), as SGLang merges them.

- snapshot / compare: a copy of the PHYSICAL stored bytes, and a bitwise comparison against it later (or a
  tolerance comparison with allow_quant_error).
- reset_tensors: as SGLang's test hook, copy random values (floats uniform in [0, 1)) into the stored bytes of
  every selected tensor, open session or not. The engine keeps serving them: nothing is marked or refused.
Block FP8 (a runner with `quantization`): hf names answer the FP8 codes and the `weight_scale_inv` scales as stored
(the bytes a sync sent); engine names answer, as SGLang's checker does, each FP8 parameter's bfloat16
dequantization (layout undone first) under the weight's name, and no separate entry for its scales.
`skip_tensor_list` holds substrings of the names of the naming mode (without the role prefix) to leave out, for
every action; a fused engine parameter is skipped or kept whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from miles_sync.engine.reference.runner_api import StoredRunner
from miles_sync.weights.checksum import (
    TensorHash,
    engine_digest,
    role_checksums,
    sglang_digest,
    sglang_engine_checksum,
    sglang_fused_tensor,
    sglang_overall_checksum,
    sglang_parameter_names,
    sglang_reported_name,
)
from miles_sync.weights.fp8 import scale_name, sglang_dequantized, weight_name
from miles_sync.weights.layout import undo_layout
from miles_sync.wire.protocol import (
    ChecksumNames,
    ParallelismInfo,
    RankChecksums,
    Role,
    WeightsCheckerAction,
    WeightsCheckerRequest,
    WeightsCheckerResult,
    role_kind,
)
from miles_sync.wire.text import shorten

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

_QUANT_RTOL = 1e-2  # allow_quant_error: the tolerance of a round trip through an 8-bit format
_QUANT_ATOL = 1e-2
_MAX_NAMES_SHOWN = 8
_MAX_RESET_DRAWS = 8

_Parts = dict[str, tuple[str, ...]]  # name in the naming mode -> the HF names of the runner's storage it covers


class WeightsChecker:
    """Stateful (it keeps the last snapshot). The caller serializes calls with weight updates."""

    def __init__(
        self,
        runners: Mapping[Role, StoredRunner],
        *,
        checksum_names: ChecksumNames = ChecksumNames.HF,
        draft_role: str = Role.DRAFT.value,
        tp_rank: int = 0,
        tp_size: int = 1,
        tensor_hash: TensorHash = TensorHash.SHA256,
    ) -> None:
        """`tensor_hash`: how engine-named digests are computed (SGLang's CPU SHA-256, or its GPU Triton hash as a
        CUDA server answers); HF-named answers are miles_sync's own checksums, so they take SHA-256 only."""
        if TensorHash(tensor_hash) is not TensorHash.SHA256 and ChecksumNames(checksum_names) is ChecksumNames.HF:
            raise ValueError(f"tensor hash {TensorHash(tensor_hash).value!r} applies to engine checksum names only")
        if role_kind(draft_role) is not Role.DRAFT:
            raise ValueError(f"draft_role {draft_role!r} is not a draft role ('draft' or 'draft_step_<i>')")
        sharded = [role.value for role, runner in runners.items() if runner.holds_shards]
        if sharded and ChecksumNames(checksum_names) is not ChecksumNames.ENGINE:
            raise ValueError(f"the {', '.join(sharded)} runner(s) hold TP shards: only engine checksum names apply")
        self._runners = runners
        self._names = ChecksumNames(checksum_names)
        self._hash = TensorHash(tensor_hash)
        self._role_names = {Role.TARGET: Role.TARGET.value, Role.DRAFT: draft_role}
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._parts: dict[Role, _Parts] = {
            role: _checker_parts(runner, self._names) for role, runner in runners.items()
        }
        self._snapshot: dict[tuple[Role, str], torch.Tensor] | None = None

    @property
    def checksum_names(self) -> ChecksumNames:
        return self._names

    @property
    def tensor_hash(self) -> TensorHash:
        return self._hash

    def handle(self, request: WeightsCheckerRequest, *, roles: set[Role]) -> WeightsCheckerResult:
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
        return self._reset(roles, skip)

    def _selected(self, roles: set[Role], skip: tuple[str, ...]) -> Iterator[tuple[StoredRunner, _Parts]]:
        """(runner, {name in this mode: HF parts}) per selected runner, target first, skipped names left out."""
        for role in (Role.TARGET, Role.DRAFT):
            runner = self._runners.get(role)
            if runner is not None and role in roles:
                parts = self._parts[role]
                yield runner, {n: parts[n] for n in sorted(parts) if not any(s in n for s in skip)}

    def _stored(self, roles: set[Role], skip: tuple[str, ...]) -> Iterator[tuple[Role, str, torch.Tensor]]:
        for runner, selected in self._selected(roles, skip):
            with runner.weights_lock:
                stored = runner.stored_tensors()
                for parts in selected.values():
                    for name in parts:
                        yield runner.role, name, stored[name]

    def _checksum(self, roles: set[Role], skip: tuple[str, ...]) -> WeightsCheckerResult:
        checksums: dict[str, str] = {}
        infos = []
        for runner, selected in self._selected(roles, skip):
            role_name = self._role_names[runner.role]
            with runner.weights_lock:
                if self._names is ChecksumNames.ENGINE and runner.quantization is not None:
                    answered = _fp8_engine_digests(runner, selected, self._hash)
                elif self._names is ChecksumNames.ENGINE:
                    stored = runner.stored_tensors()
                    answered = {
                        name: sglang_digest(_fused([stored[part] for part in parts]), self._hash)
                        for name, parts in selected.items()
                    }
                else:
                    answered = role_checksums(_logical(runner, list(selected)), role=Role.TARGET.value)
            for name, digest in answered.items():
                key = sglang_reported_name(role_name, name)
                if key in checksums:  # SGLang refuses a merge that would hide one runner's tensor behind another's
                    raise ValueError(f"checksum key collision: {key}")
                checksums[key] = digest
            infos.append(
                ParallelismInfo(
                    role=role_name,
                    tp_rank=self._tp_rank,
                    tp_size=self._tp_size,
                    dp_rank=0,
                    dp_size=1,
                    pp_rank=0,
                    pp_size=1,
                    rank=self._tp_rank,
                    size=self._tp_size,
                )
            )
        if self._names is ChecksumNames.ENGINE:
            per_gpu = sglang_overall_checksum(checksums)
            per_engine = sglang_engine_checksum([per_gpu])
        else:
            per_gpu = per_engine = engine_digest(checksums)
        rank = RankChecksums(checksums=checksums, per_gpu_checksum=per_gpu, parallelism_info=tuple(infos))
        return WeightsCheckerResult(
            success=True,
            message=f"checksums of {len(checksums)} tensor(s)",
            ranks=(rank,),
            per_engine_checksum=per_engine,
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
        num_reset = 0
        for runner, selected in self._selected(roles, skip):
            names = [name for parts in selected.values() for name in parts]
            with runner.weights_lock:
                stored = runner.stored_tensors()
                runner.overwrite([(name, _random_unlike(stored[name])) for name in names])
            num_reset += len(names)
        return WeightsCheckerResult(success=True, message=f"reset {num_reset} tensor(s) to random values")


def _checker_parts(runner: StoredRunner, names: ChecksumNames) -> _Parts:
    """{name the checker answers: the stored tensors it covers}. A sharded runner stores the engine's own fused
    parameters already; a TP=1 runner stores HF tensors, fused here for engine names."""
    if runner.holds_shards:
        return {name: (name,) for name in runner.stored_tensors()}
    if names is ChecksumNames.ENGINE:
        return sglang_parameter_names(runner.owned_names())
    return {name: (name,) for name in runner.owned_names()}


def _fp8_engine_digests(runner: StoredRunner, selected: _Parts, kind: TensorHash) -> dict[str, str]:
    """Engine-name digests of a block-FP8 runner (SGLang's checker): a parameter whose parts all have scales is
    hashed as its bfloat16 dequantization, the scales' own entries are left out, everything else as stored."""
    stored = runner.stored_tensors()
    shuffled = runner.shuffled_names() - runner.loaded_in_session()
    answered = {}
    for name, parts in selected.items():
        if all(weight_name(part) is not None and weight_name(part) in stored for part in parts):
            continue  # scales: compared through their weight
        if all(scale_name(part) in stored for part in parts):
            codes = [undo_layout(stored[p], runner.layout) if p in shuffled else stored[p] for p in parts]
            scales = [stored[scale_name(p)] for p in parts]
            fused = sglang_dequantized(
                sglang_fused_tensor(name, codes), sglang_fused_tensor(name, scales), runner.quantization.block
            )
            answered[name] = sglang_digest(fused, kind)
        else:
            answered[name] = sglang_digest(_fused([stored[part] for part in parts]), kind)
    return answered


def _fused(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _logical(runner: StoredRunner, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stored tensors with the layout undone; bytes loaded in an open session are not shuffled yet."""
    stored = runner.stored_tensors()
    shuffled = runner.shuffled_names() - runner.loaded_in_session()
    for name in names:
        yield name, (undo_layout(stored[name], runner.layout) if name in shuffled else stored[name])


def _equal(a: torch.Tensor, b: torch.Tensor, *, allow_quant_error: bool) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if allow_quant_error and a.is_floating_point():
        return torch.allclose(a.float(), b.float(), rtol=_QUANT_RTOL, atol=_QUANT_ATOL)
    # Bitwise: NaN payloads and -0.0 count as differences, as they would in a kernel.
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _random_like(t: torch.Tensor) -> torch.Tensor:
    """SGLang's `_random_like`: floats uniform in [0, 1) drawn in float32, bools fair coins; integers uniform over
    every bit pattern. Unseeded: each call draws new values."""
    if t.is_floating_point():
        return torch.rand(t.shape, dtype=torch.float32).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape) > 0.5
    num_bytes = t.numel() * t.element_size()
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8).view(t.dtype).reshape(t.shape)


def _random_unlike(t: torch.Tensor) -> torch.Tensor:
    """`_random_like(t)`, drawn again while it equals `t` bitwise (a one-element bool has even odds), so a reset
    always changes a non-empty tensor."""
    for _ in range(_MAX_RESET_DRAWS):
        values = _random_like(t)
        if t.numel() == 0 or not _equal(values, t, allow_quant_error=False):
            return values
    return ~t if t.dtype == torch.bool else values  # only tiny tensors of few values get here


def _shown(names: list[str]) -> str:
    return f"[{shorten(map(repr, names), limit=_MAX_NAMES_SHOWN)}]"
