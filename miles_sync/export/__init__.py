"""Megatron-core parameter export: TP/PP/EP shards -> atomic units of full HF-named tensors, and back.

Raw mode (this package's converters) in `megatron` (export) and `loader` (import); bridge mode in `bridge`.
megatron-core is imported lazily, so importing this package is cheap.
"""
