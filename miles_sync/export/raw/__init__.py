"""Raw converters: one module per model family, picked once by name through `create_converter`.

Family modules import lazily, so asking for one family never imports the others.
"""

from __future__ import annotations

import importlib

from miles_sync.export.converter import Converter

# arch name (the HF config's model_type) -> (module, class)
_FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("miles_sync.export.raw.llama", "LlamaConverter"),
    "qwen2": ("miles_sync.export.raw.qwen2", "Qwen2Converter"),
    "qwen3": ("miles_sync.export.raw.qwen3", "Qwen3Converter"),
    "qwen3_moe": ("miles_sync.export.raw.qwen3_moe", "Qwen3MoeConverter"),
}

SUPPORTED_ARCHS: tuple[str, ...] = tuple(_FAMILIES)


def check_arch(arch: str) -> None:
    """Raise ValueError naming `arch` and the supported list unless raw export supports it."""
    if arch not in _FAMILIES:
        raise ValueError(f"raw export does not support arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")


def create_converter(arch: str, hf_config: object) -> Converter:
    """The raw converter for `arch` (an HF `model_type`), sized from `hf_config`.

    MTP layers need no separate choice: every family maps `mtp.layers.*` when the model has them.
    Raises ValueError naming an unsupported arch and the supported list.
    """
    check_arch(arch)
    module_name, class_name = _FAMILIES[arch]
    converter_class = getattr(importlib.import_module(module_name), class_name)
    return converter_class(hf_config)


__all__ = ["check_arch", "create_converter"]
