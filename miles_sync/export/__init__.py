"""Megatron-core parameter export: TP/PP/EP shards -> atomic units of full HF-named tensors, and back.

Raw mode (this package's converters) in `megatron` (export) and `loader` (import); bridge mode in `bridge`.
megatron-core is imported lazily, so importing this package is cheap.
"""

from miles_sync.export.converter import Converter, Layout, TensorMapping
from miles_sync.export.loader import load_hf_checkpoint
from miles_sync.export.megatron import export_metadata, is_export_source, iter_hf_units, model_chunks
from miles_sync.export.raw import SUPPORTED_ARCHS, check_arch, create_converter
from miles_sync.export.units import ExportedUnit
from miles_sync.megatron.model_builder import build_gpt_model, padded_vocab_size, transformer_config_from_hf

__all__ = [
    "SUPPORTED_ARCHS",
    "Converter",
    "ExportedUnit",
    "Layout",
    "TensorMapping",
    "build_gpt_model",
    "check_arch",
    "create_converter",
    "export_metadata",
    "is_export_source",
    "iter_hf_units",
    "load_hf_checkpoint",
    "model_chunks",
    "padded_vocab_size",
    "transformer_config_from_hf",
]
