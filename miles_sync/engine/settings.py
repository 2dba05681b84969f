"""What launching one engine needs, whatever its kind: `EngineSettings` (each kind's spec reads its slice)."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.codec import WireEnum
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.text import raise_if

__all__ = ["EngineSettings", "FinalizePolicy", "LoraSettings"]


class FinalizePolicy(WireEnum):
    """What the reference engine's `end_weight_update` post-processes (miles_sync.engine.reference.engine).

    strict: finalize exactly the runners that received bytes, and fail a selected runner that got none.
    sglang: finalize every selected runner, as SGLang does (reproduces the double-transform bug).
    no_selector: a server without selector support (an older SGLang, a fork): it accepts the selector field and
    ignores it, so every runner is in every session and is finalized at its end, as with `sglang` and selector
    `all`. The draft guard (miles_sync.sync.draft_guard) exists to catch this server."""

    STRICT = "strict"
    SGLANG = "sglang"
    NO_SELECTOR = "no_selector"


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """An engine that serves LoRA adapters loaded later (from tensors, at every sync): the adapter shape it reserves
    room for at start. `target_modules` are SGLang's module names (`q_proj`, `gate_up_proj`, ... or `all` alone);
    `max_loras_per_batch` / `max_loaded_loras`: None keeps the engine's default (SGLang: 8 / unlimited)."""

    max_rank: int
    target_modules: tuple[str, ...]
    max_loras_per_batch: int | None = None
    max_loaded_loras: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.max_rank < 1:
            problems.append(f"max_rank={self.max_rank} must be at least 1")
        modules = list(self.target_modules)
        if not modules or any(not m.strip() for m in modules) or len(set(modules)) != len(modules):
            problems.append(f"target_modules={modules} must name distinct modules, at least one")
        if "all" in modules and len(modules) > 1:
            problems.append(f"target_modules={modules}: 'all' must be the only module")
        for name in ("max_loras_per_batch", "max_loaded_loras"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name}={value} must be at least 1 (or None)")
        per_batch, loaded = self.max_loras_per_batch, self.max_loaded_loras
        if loaded is not None and loaded < (8 if per_batch is None else per_batch):  # SGLang's rule, its default 8
            problems.append(f"max_loaded_loras={loaded} must be at least max_loras_per_batch ({per_batch or 8})")
        raise_if(problems, what="invalid LoraSettings")


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """One engine's launch inputs. Options a kind has no use for are ignored by its spec: SGLang has no flag for
    the weight layout, the finalize policy or a collective timeout; the reference engine names its draft by
    `draft_kind` alone and serves no LoRA adapters."""

    model_dir: str
    speculative_algorithm: str | None = None  # SGLang's name (NEXTN, EAGLE, ...); None: no speculative decoding
    draft_kind: DraftKind = DraftKind.NONE
    draft_dir: str | None = None  # standalone drafts only
    weight_layout: WeightLayout = WeightLayout.NONE
    finalize_policy: FinalizePolicy = FinalizePolicy.STRICT
    spec_steps: int = 3
    tp_size: int = 1  # tensor-parallel ranks of the engine
    collective_timeout_s: float | None = None
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or a report
    admin_api_key: str | None = field(default=None, repr=False)
    lora: LoraSettings | None = None  # None: the engine serves the base model only
    device: str | None = None  # SGLang's --device ("cpu" adds the CPU flags); None: SGLang's default
    server_python: str | None = None  # the interpreter that runs an SGLang server; None: this one
    # Import paths a tensor update may name as its load_format (`--custom-weight-loader`, both kinds): the loader
    # of a transport that needs one (TransportSpec.custom_weight_loader).
    custom_weight_loaders: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"invalid EngineSettings: tp_size={self.tp_size} must be at least 1")
