"""The conversion axis: `ConversionMode` and its registry of exporters (how trainer parameters become HF tensors).

Adding a mode touches its module and one row here. Each row builds, once per model, the export stream factory
(a fresh stream of ExportedUnits per call: the model's current weights) and the metadata of the units that stream
yields. The rows import their modules lazily: megatron-core and megatron-bridge load only when a model is attached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from miles_sync.export.units import ExportedUnit
from miles_sync.wire.bucket import AtomicUnit
from miles_sync.wire.codec import WireEnum
from miles_sync.wire.dtypes import config_dtype

__all__ = ["ConversionMode", "build_exporter"]


class ConversionMode(WireEnum):
    """How trainer parameters become HF tensors. The raw converters cannot emit draft (MTP) weights."""

    RAW = "raw"
    BRIDGE = "bridge"


ExportStream = Callable[[], Iterable[ExportedUnit]]
# (model, *, hf_config, timeout_s: the collective timeout) -> (export stream factory, unit metadata)
Exporter = Callable[..., tuple[ExportStream, list[AtomicUnit]]]


def _raw_exporter(model: Any, *, hf_config: Any, timeout_s: float) -> tuple[ExportStream, list[AtomicUnit]]:
    """miles_sync's converters; every rank runs the gather's collectives, the source rank gets the HF tensors.

    Every tensor leaves in the checkpoint's dtype, the one the engines hold: megatron keeps a local-spec model's
    norms in float32 under bf16, which an engine serving the bf16 checkpoint would refuse."""
    from miles_sync.export.megatron import export_metadata, iter_hf_units
    from miles_sync.export.raw import create_converter

    converter = create_converter(hf_config.model_type, hf_config)
    dtype = config_dtype(hf_config)

    def units() -> Iterator[ExportedUnit]:
        return iter_hf_units(model, converter=converter, source_rank_only=True, timeout_s=timeout_s, dtype=dtype)

    return units, export_metadata(model, converter=converter, dtype=dtype)


def _bridge_exporter(model: Any, *, hf_config: Any, timeout_s: float) -> tuple[ExportStream, list[AtomicUnit]]:
    """megatron-bridge's conversion of the same model (its own collectives; `timeout_s` is not used)."""
    del timeout_s
    from miles_sync.export.bridge import BridgeExporter, bridge_for_config

    exporter = BridgeExporter(bridge_for_config(hf_config), model)
    return exporter.iter_units, exporter.metadata()


EXPORTERS: dict[ConversionMode, Exporter] = {
    ConversionMode.RAW: _raw_exporter,
    ConversionMode.BRIDGE: _bridge_exporter,
}


def build_exporter(
    model: Any, *, hf_config: Any, conversion: ConversionMode | str, timeout_s: float
) -> tuple[ExportStream, list[AtomicUnit]]:
    """The export stream factory and its unit metadata for `conversion`, chosen once per model."""
    return EXPORTERS[ConversionMode(conversion)](model, hf_config=hf_config, timeout_s=timeout_s)
