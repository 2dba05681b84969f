"""What launching one engine needs, whatever its kind: `EngineSettings` (each kind's spec reads its slice)."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.codec import WireEnum
from miles_sync.wire.draft import DraftKind

__all__ = ["EngineSettings", "FinalizePolicy"]


class FinalizePolicy(WireEnum):
    """What the reference engine's `end_weight_update` post-processes (miles_sync.engine.reference.engine).

    strict: finalize exactly the runners that received bytes, and fail a selected runner that got none.
    sglang: finalize every selected runner, as SGLang does (reproduces the double-transform bug)."""

    STRICT = "strict"
    SGLANG = "sglang"


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """One engine's launch inputs. Options a kind has no use for are ignored by its spec (SGLang reads its draft,
    layout and finalize behaviour from its own flags)."""

    model_dir: str
    draft_kind: DraftKind = DraftKind.NONE
    draft_dir: str | None = None  # standalone drafts only
    weight_layout: WeightLayout = WeightLayout.NONE
    finalize_policy: FinalizePolicy = FinalizePolicy.STRICT
    spec_steps: int = 3
    tp_size: int = 1  # tensor-parallel ranks of the engine
    collective_timeout_s: float | None = None
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or a report
    admin_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"invalid EngineSettings: tp_size={self.tp_size} must be at least 1")
