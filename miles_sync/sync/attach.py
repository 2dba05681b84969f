"""Which model a trainer process attached for syncing: a per-process registry of `ModelSource`s by name.

The public calls are re-exported by `miles_sync.embedding` (the documented path); the Ray side reaches an
attached model through `actors.remote_source`.
"""

from __future__ import annotations

import threading
from typing import Any

from miles_sync.env import read_environment
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.source import ModelSource
from miles_sync.transport.feeds import FeedPlan

__all__ = ["DEFAULT_ATTACHMENT", "attach_model", "attached_source", "detach_model"]

DEFAULT_ATTACHMENT = "default"

_attached: dict[str, ModelSource] = {}
_attached_lock = threading.Lock()


def attach_model(
    model: Any,
    *,
    hf_config: Any,
    conversion: ConversionMode | str = ConversionMode.RAW,
    name: str = DEFAULT_ATTACHMENT,
    collective_timeout_s: float | None = None,
    feeds: FeedPlan | None = None,
) -> ModelSource:
    """Hand this rank's Megatron model to miles_sync; call it on every rank of the model, once.

    `model`: this rank's megatron-core GPTModel (or its list of virtual-pipeline chunks; DDP/Float16 wrappers are
    fine). `hf_config`: the transformers config of the checkpoint the engines serve (names and shapes of the HF
    tensors come from it). `conversion`: "raw" (miles_sync's converters) or "bridge" (megatron-bridge). `name`
    tells several attached models of one process apart. The model is read, never written; attaching again under
    the same name replaces the previous model. Returns the rank's ModelSource.

    `feeds` (the colocated transport only; the same plan on every rank): which trainer rank feeds each engine TP
    rank, from the devices they run on (`miles_sync.transport.feeds.plan_feeds`, or `placement.plan_colocated_feeds`
    for a miles_sync placement plan). Without it the export source alone hands every engine rank a handle to its
    own memory: fine on CPU and where all engine ranks share the source's GPU, refused by SGLang ("Invalid
    device_uuid") for an engine rank on another GPU.
    """
    if not name:
        raise ValueError("attach_model: name must be a non-empty string")
    timeout_s = read_environment().collective_timeout_s if collective_timeout_s is None else collective_timeout_s
    conversion = ConversionMode(conversion)
    source = ModelSource(model, hf_config=hf_config, conversion=conversion, collective_timeout_s=timeout_s, feeds=feeds)
    with _attached_lock:
        previous, _attached[name] = _attached.get(name), source
    if previous is not None:
        previous.shutdown()
    return source


def attached_source(name: str = DEFAULT_ATTACHMENT) -> ModelSource:
    """The ModelSource attached in this process under `name`; raises LookupError naming the attached ones."""
    with _attached_lock:
        source = _attached.get(name)
        names = sorted(_attached)
    if source is None:
        raise LookupError(
            f"no model attached under {name!r} in this process (attached: {names}); call "
            f"miles_sync.sync.attach.attach_model(model, hf_config=...) on every trainer rank first"
        )
    return source


def detach_model(name: str = DEFAULT_ATTACHMENT) -> None:
    """Drop the model attached under `name` and release its transport. Idempotent."""
    with _attached_lock:
        source = _attached.pop(name, None)
    if source is not None:
        source.shutdown()
