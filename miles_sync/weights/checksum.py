"""Bitwise weight checksums: trainer-side HF tensors vs what each engine holds after a sync.

A tensor's checksum is SHA-256 over a header (dtype name and shape) followed by its raw bytes, so a
reinterpretation of the same bytes (bf16 vs int16, (4, 8) vs (8, 4)) never matches. SHA-256 is the fastest correct
choice measured with what ships with Python here (SHA extensions make it as fast as SHA-1 and over twice as fast
as BLAKE2b; see benchmarks/bench_checksum.py), and hashlib releases the GIL while hashing.

Engines that store weights in a transformed physical layout (AITER shuffle) report *logical* checksums by undoing
the layout first, so engines with different layouts and the trainer all agree on one value per tensor.

The `sglang_*` functions reproduce what SGLang's own weights checker answers instead: the engine's fused parameter
names (`qkv_proj`, `gate_up_proj`, the stacked MoE experts `experts.w13_weight` / `w2_weight`), the physical bytes,
each digest the first 8 bytes of SHA-256 over the raw bytes (no header) on a CPU server, SGLang's Triton tensor
hash on a GPU server (`TensorHash`, `sglang_digest`; miles_sync.weights.gpu_hash computes it on any device), and
SGLang's overall and per-engine digests. Predicting a real server's answer needs them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence

import torch

from miles_sync.weights.layout import WeightLayout, undo_layout
from miles_sync.wire.codec import WireEnum
from miles_sync.wire.dtypes import dtype_name

__all__ = [
    "TensorHash",
    "compare_checksums",
    "engine_digest",
    "raw_sha256",
    "raw_sha256_digest",
    "role_checksums",
    "sglang_engine_checksum",
    "sglang_fused_tensor",
    "sglang_overall_checksum",
    "sglang_parameter_names",
    "sglang_digest",
    "sglang_reported_name",
    "tensor_checksum",
]

ROLES = ("target", "draft")
DRAFT_PREFIX = "draft."  # draft-role names are reported with this prefix, as SGLang's weights_checker does


def tensor_checksum(t: torch.Tensor) -> str:
    """SHA-256 hex digest of dtype, shape and raw bytes. Device tensors are copied to host; `t` is not mutated."""
    header = f"{dtype_name(t.dtype)}[{','.join(str(d) for d in t.shape)}]\n".encode()
    host = t.detach().resolve_conj().resolve_neg().contiguous().cpu()
    # reshape(-1) first: 0-dim tensors cannot be viewed as bytes directly.
    data = host.reshape(-1).view(torch.uint8).numpy()
    h = hashlib.sha256(header)
    h.update(data)
    return h.hexdigest()


def raw_sha256(t: torch.Tensor) -> str:
    """Plain SHA-256 hex of the raw bytes alone (no dtype or shape header): SGLang's LoRA `expected_checksums`."""
    return raw_sha256_digest(t).hex()


def raw_sha256_digest(t: torch.Tensor) -> bytes:
    """SHA-256 of the raw bytes alone, as 32 bytes: what `raw_sha256` and `sglang_tensor_hash` print in hex (the p2p
    transport sends it beside each parameter, so a parameter hashed for its engine digest is not hashed twice)."""
    host = t.detach().resolve_conj().resolve_neg().contiguous().cpu()
    return hashlib.sha256(host.reshape(-1).view(torch.uint8).numpy()).digest()


def logical_checksum(t: torch.Tensor, *, layout: WeightLayout | str) -> str:
    """Checksum of the logical tensor behind a physical `layout` (the inverse transform is applied to a copy)."""
    return tensor_checksum(undo_layout(t, layout))


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"Unknown role {role!r}; expected one of: {', '.join(ROLES)}")


def role_checksums(
    named: Iterable[tuple[str, torch.Tensor]],
    *,
    role: str,
    layouts: Mapping[str, WeightLayout | str] | None = None,
) -> dict[str, str]:
    """{reported name: checksum} for one runner's tensors; draft-role names get the "draft." prefix.

    `layouts` maps (unprefixed) tensor names to the physical layout they are stored in; those tensors are hashed
    after undoing it, the rest as they are. Raises ValueError for an unknown role, a duplicate name, or a layout
    entry naming a tensor that is not in `named` (a stale or misspelled entry would otherwise hide silently).
    """
    _check_role(role)
    layouts = {} if layouts is None else layouts
    prefix = DRAFT_PREFIX if role == "draft" else ""
    checksums: dict[str, str] = {}
    seen: set[str] = set()
    duplicates: set[str] = set()
    for name, t in named:
        if name in seen:
            duplicates.add(name)
            continue
        seen.add(name)
        layout = layouts.get(name)
        checksums[prefix + name] = tensor_checksum(t) if layout is None else logical_checksum(t, layout=layout)
    unknown = sorted(set(layouts) - seen)
    if duplicates or unknown:
        raise ValueError(f"role_checksums: duplicate names {sorted(duplicates)}, layouts for unknown names {unknown}")
    return checksums


def engine_digest(checksums: Mapping[str, str]) -> str:
    """One SHA-256 over the sorted (name, checksum) pairs; independent of insertion order.

    Each field is length-prefixed so that no two different maps serialize to the same byte stream.
    """
    h = hashlib.sha256()
    for name in sorted(checksums):
        for field in (name.encode(), checksums[name].encode()):
            h.update(f"{len(field)}:".encode())
            h.update(field)
    return h.hexdigest()


def compare_checksums(expected: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """Readable mismatch lines, empty when the maps are equal: differing names first, then missing (expected but
    not reported), then extra (reported but not expected); each group sorted by name."""
    differs = sorted(n for n in expected.keys() & actual.keys() if expected[n] != actual[n])
    missing = sorted(expected.keys() - actual.keys())
    extra = sorted(actual.keys() - expected.keys())
    return [
        *(f"differs {n}: expected {expected[n]}, got {actual[n]}" for n in differs),
        *(f"missing {n}: expected {expected[n]}, not reported" for n in missing),
        *(f"extra {n}: reported {actual[n]}, not expected" for n in extra),
    ]


# ---- SGLang's checker -----------------------------------------------------------------------------------------

# (engine parameter, HF parts it concatenates along dim 0 in this order), relative to one module prefix; the
# parallel linears of SGLang's models (QKVParallelLinear, MergedColumnParallelLinear) own one fused parameter.
_SGLANG_FUSIONS = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)
_SGLANG_FUSED_LEAVES = ("weight", "bias")


# SGLang's FusedMoE stacks the experts of one MoE block: `w13_weight` [E, 2I, H] is, per expert, the gate (w1) rows
# then the up (w3) rows; `w2_weight` [E, H, I] the down projections. Leaf -> (HF projections per expert, in order).
_SGLANG_EXPERT_FUSIONS = (
    ("w13_weight", ("gate_proj", "up_proj")),
    ("w2_weight", ("down_proj",)),
)
_EXPERT_NAME = re.compile(r"^(?P<head>(?:.*\.)?mlp\.experts\.)(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def sglang_parameter_names(names: Iterable[str], *, num_experts: int | None = None) -> dict[str, tuple[str, ...]]:
    """{SGLang parameter name: the HF names it holds, concatenated along dim 0 in this order} for one runner.

    q/k/v of one attention become `<prefix>self_attn.qkv_proj.<leaf>`, gate/up become `<prefix>mlp.gate_up_proj.<leaf>`
    (leaf `weight` or `bias`), only when every part is present. The experts of one MoE block
    (`<prefix>mlp.experts.<e>.{gate,up,down}_proj.weight`) become `<prefix>mlp.experts.w13_weight` (gate_0, up_0,
    gate_1, up_1, ...) and `<prefix>mlp.experts.w2_weight` (down_0, down_1, ...), only when every expert's parts are
    present: experts 0..num_experts-1, or, with `num_experts` None, 0..the highest index seen. Every other name
    (a partial group included) maps to itself alone. `sglang_fused_tensor` builds the fused tensor from its parts.
    """
    remaining = set(names)
    result: dict[str, tuple[str, ...]] = {}
    for name in sorted(remaining):
        for fused, parts in _SGLANG_FUSIONS:
            for leaf in _SGLANG_FUSED_LEAVES:
                first = f"{parts[0]}.{leaf}"
                head = name[: -len(first)]
                if not name.endswith(first) or (head and not head.endswith(".")):
                    continue
                members = tuple(f"{head}{part}.{leaf}" for part in parts)
                if all(member in remaining for member in members):
                    result[f"{head}{fused}.{leaf}"] = members
    result.update(_expert_fusions(remaining, num_experts=num_experts))
    fused_members = {member for members in result.values() for member in members}
    for name in remaining - fused_members:
        result[name] = (name,)
    return result


def _expert_fusions(names: set[str], *, num_experts: int | None) -> dict[str, tuple[str, ...]]:
    experts: dict[str, set[int]] = {}  # MoE block head -> expert indices seen
    for name in names:
        match = _EXPERT_NAME.match(name)
        if match is not None:
            experts.setdefault(match["head"], set()).add(int(match["expert"]))
    result = {}
    for head, seen in experts.items():
        count = max(seen) + 1 if num_experts is None else num_experts
        if seen - set(range(count)):  # an index past the model's experts: nothing of this block is fused
            continue
        for leaf, projections in _SGLANG_EXPERT_FUSIONS:
            members = tuple(f"{head}{e}.{proj}.weight" for e in range(count) for proj in projections)
            if all(member in names for member in members):
                result[f"{head}{leaf}"] = members
    return result


def sglang_fused_tensor(engine_name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The engine parameter `engine_name` from its parts (full tensors or one rank's slices), in the order of
    `sglang_parameter_names`: a lone part itself, else the parts concatenated along dim 0; stacked experts
    (`w13_weight`, `w2_weight`) are viewed as [num_experts, rows per expert, columns], FusedMoE's shape, so a
    layout applies per expert on the last two dims. Its bytes are the parts' bytes one after another."""
    if len(parts) == 1:
        return parts[0]
    fused = torch.cat(list(parts), dim=0)
    for leaf, projections in _SGLANG_EXPERT_FUSIONS:
        if engine_name.endswith(f"experts.{leaf}"):
            return fused.view(len(parts) // len(projections), -1, fused.shape[-1])
    return fused


def sglang_reported_name(role_name: str, name: str) -> str:
    """How SGLang merges its runners' checksum answers: only draft roles are prefixed ("draft.", "draft_step_0.")."""
    return name if role_name == "target" else f"{role_name}.{name}"


def sglang_tensor_hash(t: torch.Tensor) -> str:
    """SGLang's CPU `tensor_hash` as the checker prints it: the first 8 bytes of SHA-256 over the raw bytes (dtype
    and shape are not hashed), as 16 lowercase hex digits (big-endian, so the hexdigest's first 16 characters)."""
    return raw_sha256_digest(t).hex()[:16]


class TensorHash(WireEnum):
    """Which digest an engine's checker answers per parameter: SGLang hashes a CPU tensor with SHA-256
    (`sglang_tensor_hash`) and a CUDA tensor with its Triton kernel (`sglang_gpu_digest`); both print 16 hex
    digits, so the answer alone does not say which: the server's device does."""

    SHA256 = "sha256"
    GPU_HASH = "gpu-hash"


def sglang_digest(t: torch.Tensor, kind: TensorHash) -> str:
    """The digest SGLang's checker prints for `t` on a server hashing with `kind`."""
    if kind is TensorHash.SHA256:
        return sglang_tensor_hash(t)
    from miles_sync.weights.gpu_hash import sglang_gpu_digest  # only a GPU server's digests need it

    return sglang_gpu_digest(t)


def sglang_overall_checksum(checksums: Mapping[str, str]) -> str:
    """SGLang's `overall_checksum`, the per_gpu_checksum: SHA-256 over name then digest, names in sorted order."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def sglang_engine_checksum(per_gpu_checksums: Sequence[str]) -> str:
    """SGLang's per_engine_checksum: SHA-256 over every rank's per_gpu_checksum, in rank order."""
    h = hashlib.sha256()
    for per_gpu in per_gpu_checksums:
        h.update(per_gpu.encode())
    return h.hexdigest()
