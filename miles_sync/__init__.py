"""miles_sync: weight synchronization from Megatron trainers to SGLang-compatible rollout engines."""

__version__ = "0.1.0"
