"""What the reference engine calls on a runner (one served model of one role), declared once.

Three classes serve a role: `runner.Runner` (TP=1, HF-named storage in the engine's process), `sharded.ShardedRunner`
(one TP rank's shard, engine-named storage, in a rank process) and `ranks.RankRunnerView` (the HTTP front's view of
one role across the rank processes; it keeps no weights). The engine's update session, the scheduler and the
speculative proposers call the `ServedRunner` surface on any of them; the weights checker and the load paths read
and write bytes through `StoredRunner`, which only the two classes that hold weights implement.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from miles_sync.weights.fp8 import Fp8Block
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.protocol import Role

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine


class ServedRunner(Protocol):
    """One role's served model as the session and scheduler see it. Names in `owned_names`, `expected`,
    `loaded_in_session`, `loaded_direct_in_session` and `finalize` are full HF names; `partially_loaded` names fused
    engine parameters only some of whose parts a session loaded. `loaded_in_session` holds logical bytes awaiting
    the finalize; `loaded_direct_in_session` physical bytes a direct load wrote, which no finalize transforms (the
    last write of a name decides which of the two holds it). `weights_epoch` grows with every load or finalize
    (the scheduler's caches key on it); every write happens under `weights_lock`."""

    role: Role
    model: Any  # what the scheduler runs forwards on (a torch module, or the rank processes' proxy)
    is_mtp: bool
    weights_lock: threading.RLock

    @property
    def weights_epoch(self) -> int: ...

    def owned_names(self) -> frozenset[str]: ...

    def expected(self, name: str) -> TensorMeta: ...

    def loaded_in_session(self) -> frozenset[str]: ...

    def loaded_direct_in_session(self) -> frozenset[str]: ...

    def partially_loaded(self) -> list[str]: ...

    def reset_session(self) -> None: ...

    def finalize(self, names: Iterable[str]) -> None: ...

    def finalize_all(self) -> None: ...


class StoredRunner(ServedRunner, Protocol):
    """A runner that holds the bytes. `holds_shards`: its storage is the engine's own fused, TP-sharded parameters
    (keyed by engine name), not HF tensors. `quantization`: the block-FP8 spec it serves in, None for the
    checkpoint's dtypes. `stored_tensors` and `overwrite` use the storage's names; `direct_problems` and `load_direct`
    the engine's parameter names (SGLang's `model.named_parameters()` on this rank: fused, sharded, local shapes)."""

    holds_shards: bool
    quantization: Fp8Block | None
    layout: WeightLayout  # the post-load layout its finalize applies (shuffled_names: the tensors it applies to)

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]: ...

    def stored_tensors(self) -> Mapping[str, torch.Tensor]: ...

    def overwrite(self, named: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def engine_parameters(self) -> Mapping[str, TensorMeta]: ...

    def direct_problems(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[str]: ...

    def load_direct(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[str]: ...

    def shuffled_names(self) -> frozenset[str]: ...
