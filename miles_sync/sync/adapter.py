"""The trainer side of a LoRA sync: one adapter version encoded for the engines (miles_sync.sync.lora runs the
session that loads it). The source rank encodes it (`encode_adapter`) and keeps the tensors its payloads point at
alive until the controller says the session ended.

Payloads: one per engine TP rank, each the full adapter: a pickled dict {name: tensor} (SGLang's adapter format),
or, from `flatten_min_bytes` on, one flattened bucket (load_format "flattened_bucket"). CPU tensors travel as
shared-memory handles: the engines must run on the source's host. `checksums` are SGLang's `expected_checksums`
(SHA-256 of each full tensor, which every TP rank receives whole and checks itself before slicing).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from miles_sync.weights.checksum import raw_sha256
from miles_sync.wire.bucket import pack_bucket
from miles_sync.wire.payload import FlattenedTensorMetadata, encode_flattened_bucket, encode_named_tensor_dict
from miles_sync.wire.protocol import LoadFormat, LoadLoRAAdapterFromTensorsRequest

__all__ = ["AdapterPayload"]


def adapter_sha256(tensor: torch.Tensor) -> str:
    """SGLang's adapter checksum: plain SHA-256 hex of the tensor's raw bytes."""
    return raw_sha256(tensor)


@dataclass(frozen=True, kw_only=True)
class AdapterPayload:
    """One adapter version, encoded for engines of each TP size in `payloads` (tp_size -> one payload per rank).
    Crosses the Ray boundary from the trainer's source rank to the controller; the tensors it names stay alive in
    the source until it is told the session ended."""

    config_dict: dict[str, Any]
    load_format: LoadFormat | None
    payloads: dict[int, tuple[str, ...]]
    checksums: dict[str, str]
    num_bytes: int
    num_tensors: int

    def request(self, *, name: str, tp_size: int) -> LoadLoRAAdapterFromTensorsRequest:
        if tp_size not in self.payloads:
            raise ValueError(f"the adapter was encoded for TP sizes {sorted(self.payloads)}, not {tp_size}")
        return LoadLoRAAdapterFromTensorsRequest(
            lora_name=name,
            config_dict=self.config_dict,
            serialized_named_tensors=self.payloads[tp_size],
            load_format=self.load_format,
            expected_checksums=self.checksums,
        )


def encode_adapter(
    named: Mapping[str, torch.Tensor],
    *,
    config_dict: Mapping[str, Any],
    tp_sizes: Iterable[int],
    flatten_min_bytes: int,
) -> tuple[AdapterPayload, list[torch.Tensor]]:
    """The payload of `named` (PEFT names -> full tensors) for engines of each TP size, and the tensors the caller
    must keep alive until every engine answered (the payloads are handles to their memory)."""
    if not named:
        raise ValueError("the adapter has no tensors: nothing would be sent")
    pairs = [(n, t.detach().contiguous()) for n, t in named.items()]
    num_bytes = sum(t.numel() * t.element_size() for _, t in pairs)
    checksums = {n: adapter_sha256(t) for n, t in pairs}
    is_flat = num_bytes >= flatten_min_bytes
    if is_flat:
        bucket = pack_bucket(pairs)
        metadata = [
            FlattenedTensorMetadata(
                name=e.name, shape=tuple(e.shape), dtype=e.dtype, start_idx=e.start, end_idx=e.end, numel=e.num_bytes
            )
            for e in bucket.entries
        ]
        kept = [bucket.buffer]

        def one() -> str:
            return encode_flattened_bucket(buffer=bucket.buffer, metadata=metadata)
    else:
        kept = [t for _, t in pairs]

        def one() -> str:
            return encode_named_tensor_dict(pairs)

    payloads = {tp: tuple(one() for _ in range(tp)) for tp in sorted(set(tp_sizes))}
    payload = AdapterPayload(
        config_dict=dict(config_dict),
        load_format=LoadFormat.FLATTENED_BUCKET if is_flat else None,
        payloads=payloads,
        checksums=checksums,
        num_bytes=num_bytes,
        num_tensors=len(pairs),
    )
    return payload, kept
