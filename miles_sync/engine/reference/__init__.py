"""The CPU reference rollout engine: real generation with speculative decoding behind SGLang's HTTP contract.

models.py (HF causal LMs, MTP head) -> runner.py (weight storage, load/finalize) -> speculative.py (proposers,
verification) -> scheduler.py (request queue, batched decode loop, pause modes). checkpoints.py builds the
deterministic pre-trained checkpoints the tests and benchmarks serve.
"""
