"""The CPU reference rollout engine: real generation with speculative decoding behind SGLang's HTTP contract.

models.py (HF causal LMs, MTP head) -> runner.py (weight storage, load/finalize) -> speculative.py (proposers,
verification) -> scheduler.py (request queue, batched decode loop, pause modes). checkpoints.py builds the
deterministic pre-trained checkpoints the tests and benchmarks serve.
"""

from miles_sync.engine.reference.models import TextCodec, load_tokenizer
from miles_sync.engine.reference.runner import (
    DRAFT_KINDS,
    Runner,
    load_mtp_runner,
    load_runners,
    load_standalone_runner,
    load_target_runner,
)
from miles_sync.engine.reference.scheduler import Scheduler

__all__ = [
    "DRAFT_KINDS",
    "Runner",
    "Scheduler",
    "TextCodec",
    "load_mtp_runner",
    "load_runners",
    "load_standalone_runner",
    "load_target_runner",
    "load_tokenizer",
]
