"""LoRA adapters served by the reference engine, as SGLang 0.5.23 serves adapters loaded from tensors.

An adapted linear module computes `W x + scale * B (A x)` for the requests that name the adapter (`lora_path`);
the others get `W x`. `scale` is PEFT's: lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).

What SGLang does and this module matches (srt/managers/tp_worker.py `load_lora_adapter_from_tensors`,
srt/lora/lora_manager.py):
- every TP rank receives the FULL adapter tensors in its own payload (entry tp_rank) and slices them itself the
  way the base layer is split: for a column-parallel module (q/k/v, gate/up) A is whole and B keeps the rank's
  output rows; for a row-parallel one (o_proj, down_proj) A keeps the rank's input columns, B is whole, and the
  rank-local `A x` is summed over the group before B;
- `expected_checksums` are checked on each rank over the tensors that rank received (full tensors, before any
  slicing): SHA-256 hex of each tensor's raw bytes; a missing, extra or different tensor fails the load, and the
  message names them ("[LORA-CHECK] rank<r> adapter sync MISMATCH ...");
- a name that is already loaded is refused ("already loaded"): replacing an adapter is unload + load;
- DoRA and added tokens are refused; the adapter never reaches a speculative draft (the draft has no LoRA manager).

Deviation: SGLang raises the checksum mismatch out of its TP worker (its scheduler has no handler for it); this
engine answers it as a failed load (400) and keeps serving every adapter it had. A load is two-phase across TP
ranks (every rank prepares, then all install) so that ranks never disagree about which adapters exist.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from miles_sync.engine.settings import LoraSettings
from miles_sync.weights.checksum import raw_sha256
from miles_sync.weights.engine_layout import ShardKind, TPShape, shard_kind, shard_tensor
from miles_sync.wire.payload import decode_payload
from miles_sync.wire.text import raise_if

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

# The linear modules an adapter may target by default (every projection of a decoder layer).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TENSOR_LORA_PATH = "__tensor__"  # SGLang's lora_path of an adapter loaded from tensors
_PEFT_NAME = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
_MAX_NAMES_SHOWN = 5  # as SGLang's message


def adapter_module(name: str) -> tuple[str, str]:
    """(module path in HF names, "A" or "B") of a PEFT adapter tensor name; ValueError for any other name."""
    match = _PEFT_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not a PEFT LoRA tensor name (base_model.model.<module>.lora_A/B.weight)")
    return match.group("module"), match.group("part")


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SGLang's adapter checksum: SHA-256 hex of the tensor's raw bytes (contiguous, on CPU)."""
    return raw_sha256(tensor)


def checksum_problems(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, str], *, tp_rank: int) -> str | None:
    """SGLang's check of one rank's received tensors against `expected_checksums`: None when every expected name
    is present with its digest and nothing else was sent, else the message naming the tensors."""
    mismatch, missing = [], []
    for name, want in expected.items():
        if name not in tensors:
            missing.append(name)
        elif tensor_sha256(tensors[name]) != want:
            mismatch.append(name)
    extra = [name for name in tensors if name not in expected]
    if not (mismatch or missing or extra):
        return None
    n = _MAX_NAMES_SHOWN
    return (
        f"[LORA-CHECK] rank{tp_rank} adapter sync MISMATCH of {len(expected)} expected: "
        f"{len(mismatch)} value-diff {mismatch[:n]}, {len(missing)} missing {missing[:n]}, "
        f"{len(extra)} extra {extra[:n]}"
    )


# SGLang's --lora-target-modules names its fused modules; the reference engine's models keep transformers' own.
_SGLANG_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_target_modules(sglang_modules: Sequence[str]) -> tuple[str, ...]:
    """transformers' leaf names of SGLang's target modules ("all": every projection; "qkv_proj": q, k and v)."""
    if "all" in sglang_modules:
        return LORA_TARGET_MODULES
    names: list[str] = []
    for module in sglang_modules:
        for name in _SGLANG_FUSED.get(module, (module,)):
            if name not in names:
                names.append(name)
    unknown = sorted(set(names) - set(LORA_TARGET_MODULES))
    if unknown:
        raise ValueError(f"--lora-target-modules {unknown} are not modules an adapter may target here")
    return tuple(names)


@dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """What serving needs from a PEFT adapter_config.json."""

    rank: int
    alpha: float
    target_modules: frozenset[str]
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_peft(cls, config: Mapping[str, Any], *, name: str) -> AdapterConfig:
        """Refuses what SGLang refuses (DoRA), naming the adapter; ValueError on a malformed config."""
        problems = []
        if str(config.get("peft_type", "LORA")).upper() != "LORA":
            problems.append(f"peft_type {config.get('peft_type')!r} is not LORA")
        if config.get("use_dora"):
            problems.append("LoRA serving currently doesn't support DoRA adapters")
        rank, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            problems.append(f"r={rank!r} must be a positive int")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            problems.append(f"lora_alpha={alpha!r} must be a number")
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            problems.append(f"target_modules={targets!r} must be a non-empty list of module names")
        raise_if(problems, what=f"Failed to load {name}")
        return cls(
            rank=rank, alpha=float(alpha), target_modules=frozenset(targets), use_rslora=bool(config.get("use_rslora"))
        )


@dataclass(frozen=True, kw_only=True)
class _ModuleDelta:
    a: torch.Tensor  # [r, local in]
    b: torch.Tensor  # [local out, r]
    scale: float
    is_row_parallel: bool  # A x is partial on each rank: summed over the TP group before B


@dataclass(frozen=True, kw_only=True)
class PreparedAdapter:
    """An adapter checked and sliced for one rank, not serving yet (`AdapterSet.install` makes it serve)."""

    name: str
    deltas: Mapping[str, _ModuleDelta]  # module path -> its delta
    num_bytes: int


class AdapterSet:
    """The adapters of one model slice (one TP rank, or the whole model at TP=1).

    Hooks on every linear module whose leaf name is in `target_modules` (the engine's --lora-target-modules) add
    the delta of the adapter each batch row names. `active(rows)` sets the row -> adapter mapping for one forward;
    rows naming None run the base. Collectives (row-parallel modules at TP > 1) follow the rows, so every rank must
    run the same forward with the same rows and the same adapters installed. Thread-safe: a forward holds the lock
    that `install` and `remove` take.
    """

    def __init__(
        self,
        root: nn.Module,
        *,
        full_weight_shapes: Mapping[str, tuple[int, ...]],
        max_rank: int,
        target_modules: Sequence[str],
        tp_rank: int = 0,
        tp_size: int = 1,
        shape: TPShape | None = None,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`full_weight_shapes`: HF weight name -> unsharded shape (what an adapter's A/B shapes are checked
        against); `shape`/`all_reduce`: the TP split and the group's sum, needed when tp_size > 1."""
        if tp_size > 1 and (shape is None or all_reduce is None):
            raise ValueError("an AdapterSet of a TP rank needs the model's TPShape and the group's all_reduce")
        self._targets = frozenset(target_modules)
        self._max_rank = max_rank
        self._tp_rank, self._tp_size, self._shape, self._all_reduce = tp_rank, tp_size, shape, all_reduce
        self._full_shapes = dict(full_weight_shapes)
        self._adapters: dict[str, PreparedAdapter] = {}
        self._rows: tuple[str | None, ...] | None = None
        self._lock = threading.RLock()
        self._modules: dict[str, nn.Module] = {}
        for path, module in root.named_modules():
            if isinstance(module, nn.Linear) and path.rsplit(".", 1)[-1] in self._targets:
                self._modules[path] = module
                module.register_forward_hook(self._hook(path))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._adapters)

    def prepare(
        self,
        name: str,
        *,
        payload: str,
        load_format: str | None,
        config_dict: Mapping[str, Any],
        expected_checksums: Mapping[str, str] | None,
        added_tokens_config: Mapping[str, int] | None = None,
    ) -> PreparedAdapter:
        """Decode this rank's payload, check it in SGLang's order (checksums, config, name, modules, shapes) and
        slice it; ValueError naming every problem. Installs nothing."""
        named = dict(decode_payload(payload, load_format=load_format, is_adapter=True))
        if expected_checksums is not None:
            message = checksum_problems(named, expected_checksums, tp_rank=self._tp_rank)
            if message is not None:
                raise ValueError(message)
        config = AdapterConfig.from_peft(config_dict, name=name)
        if added_tokens_config:
            raise ValueError(
                f"Failed to load {name} because LoRA serving currently doesn't support adapters that add tokens "
                f"to the vocabulary"
            )
        if name in self._adapters:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        problems = []
        if config.rank > self._max_rank or not config.target_modules <= self._targets:
            problems.append(
                f"LoRA adapter {name} with rank {config.rank} is incompatible with the current LoRA memory pool "
                f"configuration (--max-lora-rank {self._max_rank}, --lora-target-modules {sorted(self._targets)})"
            )
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for tensor_name, tensor in named.items():
            try:
                module, part = adapter_module(tensor_name)
            except ValueError as exc:
                problems.append(str(exc))
                continue
            if module not in self._modules:
                problems.append(f"{tensor_name}: this model has no adapted module {module!r}")
                continue
            parts.setdefault(module, {})[part] = tensor
        deltas = {}
        for module, ab in sorted(parts.items()):
            if set(ab) != {"A", "B"}:
                problems.append(f"module {module!r} has lora_{''.join(sorted(ab))} without its pair")
                continue
            out_features, in_features = self._full_shapes[f"{module}.weight"]
            want = {"A": (config.rank, in_features), "B": (out_features, config.rank)}
            bad = [f"lora_{p} {list(ab[p].shape)} (expected {list(want[p])})" for p in "AB" if ab[p].shape != want[p]]
            if bad:
                problems.append(f"module {module!r}: " + ", ".join(bad))
                continue
            deltas[module] = self._slice(module, ab["A"], ab["B"], scale=config.scale)
        raise_if(problems, what=f"Failed to load LoRA adapter {name}")
        num_bytes = sum(t.numel() * t.element_size() for t in named.values())
        return PreparedAdapter(name=name, deltas=deltas, num_bytes=num_bytes)

    def _slice(self, module: str, a: torch.Tensor, b: torch.Tensor, *, scale: float) -> _ModuleDelta:
        """This rank's copy of A and B, split as the base weight is, in the weight's dtype (copied: a payload views
        the producer's memory)."""
        weight_name = f"{module}.weight"
        dtype = self._modules[module].weight.dtype
        kind = shard_kind(weight_name) if self._tp_size > 1 else ShardKind.REPLICATED
        if kind is ShardKind.VOCAB:
            raise ValueError(f"module {module!r} is vocab-parallel: adapters on it are not served here")
        split = dict(shape=self._shape, tp_rank=self._tp_rank, tp_size=self._tp_size)
        is_row = kind is ShardKind.ROW
        if is_row:
            a = shard_tensor(weight_name, a, **split)
        elif kind is not ShardKind.REPLICATED:
            b = shard_tensor(weight_name, b, **split)
        return _ModuleDelta(
            a=a.to(dtype).contiguous().clone(), b=b.to(dtype).contiguous().clone(), scale=scale, is_row_parallel=is_row
        )

    def install(self, prepared: PreparedAdapter) -> None:
        with self._lock:
            if prepared.name in self._adapters:
                raise ValueError(f"Failed to load LoRA adapter {prepared.name} because it is already loaded")
            self._adapters[prepared.name] = prepared

    def remove(self, name: str) -> None:
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise ValueError(f"LoRA adapter {name} is not loaded (loaded: {sorted(self._adapters)})")

    @contextlib.contextmanager
    def active(self, rows: Sequence[str | None] | None) -> Iterator[None]:
        """Serve the next forward with adapter `rows[i]` on batch row i (None: the base for every row)."""
        with self._lock:
            if rows is not None:
                unknown = sorted({r for r in rows if r is not None and r not in self._adapters})
                if unknown:
                    raise ValueError(f"LoRA adapter(s) {unknown} are not loaded (loaded: {sorted(self._adapters)})")
            self._rows = None if rows is None or all(r is None for r in rows) else tuple(rows)
            try:
                yield
            finally:
                self._rows = None

    def _hook(self, module: str) -> Callable[..., torch.Tensor | None]:
        def add_deltas(_: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
            rows = self._rows
            if rows is None:
                return None
            x = inputs[0]
            delta = torch.zeros_like(output)
            # One pass per distinct adapter, in sorted order: the same collectives in the same order on every rank.
            for name in sorted({r for r in rows if r is not None}):
                part = self._adapters[name].deltas.get(module)
                if part is None:
                    continue
                index = torch.tensor([i for i, r in enumerate(rows) if r == name], dtype=torch.long)
                low = x.index_select(0, index) @ part.a.T
                if part.is_row_parallel and self._all_reduce is not None:
                    low = self._all_reduce(low.contiguous())
                delta.index_copy_(0, index, part.scale * (low @ part.b.T))
            return output + delta

        return add_deltas


class LocalAdapters:
    """The engine's adapters when its weights live in its own process (TP=1)."""

    tp_size = 1

    def __init__(self, adapters: AdapterSet) -> None:
        self._set = adapters

    @property
    def names(self) -> tuple[str, ...]:
        return self._set.names

    def load(self, name: str, *, payloads: Sequence[str], **fields: Any) -> int:
        """Check and install adapter `name` (see `AdapterSet.prepare` for `fields`); returns its bytes."""
        _check_payload_count(payloads, tp_size=1)
        prepared = self._set.prepare(name, payload=payloads[0], **fields)
        self._set.install(prepared)
        return prepared.num_bytes

    def unload(self, name: str) -> None:
        self._set.remove(name)

    def forward(self, model: Callable[[torch.Tensor], Any], input_ids: torch.Tensor, rows: Sequence[str | None]):
        with self._set.active(rows):
            return model(input_ids)


class RankAdapters:
    """The engine's adapters across its TP rank processes: each rank holds an `AdapterSet` over its slice.

    A load is two-phase: every rank prepares its own payload; only when all succeeded does every rank install,
    else every rank drops what it prepared, so the ranks never disagree about which adapters exist.
    """

    def __init__(self, fleet: Any) -> None:
        """`fleet`: the engine's `miles_sync.engine.reference.ranks.RankFleet`."""
        self._fleet = fleet
        self._names: list[str] = []

    @property
    def tp_size(self) -> int:
        return self._fleet.tp_size

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._names)

    def load(self, name: str, *, payloads: Sequence[str], **fields: Any) -> int:
        _check_payload_count(payloads, tp_size=self.tp_size)
        per_rank = [dict(name=name, payload=payload, **fields) for payload in payloads]
        try:
            sizes = self._fleet.call("control", "prepare_adapter", per_rank=per_rank)
        except ValueError:
            self._fleet.call("control", "drop_prepared_adapter")
            raise
        self._fleet.call("control", "install_adapter")
        self._names.append(name)
        return sizes[0]

    def unload(self, name: str) -> None:
        if name not in self._names:
            raise ValueError(f"LoRA adapter {name} is not loaded (loaded: {sorted(self._names)})")
        self._fleet.call("control", "remove_adapter", name=name)
        self._names.remove(name)

    def forward(self, model: Any, input_ids: torch.Tensor, rows: Sequence[str | None]):
        del model  # the ranks run their own slices
        (out, *_) = self._fleet.call("compute", "forward", role="target", input_ids=input_ids, lora_rows=list(rows))
        return out


def _check_payload_count(payloads: Sequence[str], *, tp_size: int) -> None:
    if len(payloads) != tp_size:
        raise ValueError(
            f"serialized_named_tensors has {len(payloads)} payloads; this engine runs TP={tp_size} and takes exactly "
            f"{tp_size} (one full copy of the adapter per TP rank)"
        )


def build_adapter_set(model: nn.Module, settings: LoraSettings, *, tp_rank: int = 0, tp_size: int = 1) -> AdapterSet:
    """An AdapterSet over a target model: `models.CausalLM` (TP=1) or `parallel_models.ShardedCausalLM` (one rank;
    its row-parallel sums run over the default process group, the engine-internal one of a rank process).
    `settings.target_modules` are SGLang's names (see `hf_target_modules`)."""
    targets = hf_target_modules(settings.target_modules)
    if tp_size == 1:
        full = {name: tuple(p.shape) for name, p in model.hf_parameters().items()}
        return AdapterSet(model.hf, full_weight_shapes=full, max_rank=settings.max_rank, target_modules=targets)

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.SUM)
        return x

    full = {name: tuple(meta.shape) for name, meta in model.full_parameter_metas().items()}
    return AdapterSet(
        model.hf,
        full_weight_shapes=full,
        max_rank=settings.max_rank,
        target_modules=targets,
        tp_rank=tp_rank,
        tp_size=tp_size,
        shape=model.shape,
        all_reduce=all_reduce,
    )
