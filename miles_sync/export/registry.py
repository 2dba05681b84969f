"""The conversion axis: how trainer parameters become HF tensors (raw converters or megatron-bridge)."""

from __future__ import annotations

from miles_sync.wire.protocol import WireEnum

__all__ = ["ConversionMode"]


class ConversionMode(WireEnum):
    """How trainer parameters become HF tensors. The raw converters cannot emit draft (MTP) weights."""

    RAW = "raw"
    BRIDGE = "bridge"
