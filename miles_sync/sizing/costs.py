"""The measured costs the sizing model runs on: per-byte rates, per-call overheads, and where they came from.

`benchmarks/sizing_fit.py` measures them on the machine at hand and writes this record as JSON; the shipped
`costs_reference.json` is the fit on the development machine (2 CPU cores, gloo on loopback) and is the CLI's
default. Per-byte rates are GB/s (10^9 bytes per second):

- `memcpy_gbps`: one copy into a preallocated buffer (the sender packing a bucket, an engine loading it);
- `fresh_copy_gbps`: one copy into newly allocated memory, page faults included (a staged sync packs every bucket
  into memory of its own, held until the send);
- `load_gbps`: an engine rank's receive-side work per byte (taking a received bucket and loading its tensors into
  the weights), fitted to real syncs;
- `hash_gbps`: the SHA-256 digests of verification (the sender's while it packs, each engine's over its weights);
- `link_gbps`, `link_latency_s`: one rank's broadcast link, fitted to the measured broadcasts of `algorithm`;
- `per_sync_s` + `per_engine_s` x engines: the HTTP barriers of one sync (pause, begin, end, version, checksum,
  resume); `per_bucket_s`: one bucket's metadata POST and collective call; `per_tensor_s`: one tensor's share of
  packing, metadata and the engine's loader;
- `overlap`: how serial the bucket pipeline is, 0 (the source's next bucket fully hidden behind the current
  bucket's transfer and load) to 1 (no overlap at all);
- `shared_cores`: the machine's cores when every process of the fit shared them (None: each its own device).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from miles_sync.sizing.collective import BroadcastAlgorithm

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sizing

REFERENCE_COSTS = Path(__file__).resolve().parent / "costs_reference.json"


@dataclass(frozen=True, kw_only=True)
class Costs:
    memcpy_gbps: float
    fresh_copy_gbps: float
    load_gbps: float
    hash_gbps: float
    link_gbps: float
    link_latency_s: float = 0.0
    algorithm: BroadcastAlgorithm = BroadcastAlgorithm.BINOMIAL
    per_sync_s: float = 0.0
    per_engine_s: float = 0.0
    per_bucket_s: float = 0.0
    per_tensor_s: float = 0.0
    overlap: float = 0.0
    shared_cores: int | None = None
    machine: str = ""  # where and from what they were measured: host, cores, torch, commit, date
    notes: str = ""

    def __post_init__(self) -> None:
        bad = [
            f"{f}={getattr(self, f)}"
            for f in ("memcpy_gbps", "fresh_copy_gbps", "load_gbps", "hash_gbps", "link_gbps")
            if not getattr(self, f) > 0
        ]
        bad += [
            f"{f}={getattr(self, f)}"
            for f in ("link_latency_s", "per_sync_s", "per_engine_s", "per_bucket_s", "per_tensor_s")
            if getattr(self, f) < 0
        ]
        if not 0.0 <= self.overlap <= 1.0:
            bad.append(f"overlap={self.overlap} (must be in [0, 1])")
        if self.shared_cores is not None and self.shared_cores < 1:
            bad.append(f"shared_cores={self.shared_cores}")
        if bad:
            raise ValueError(f"invalid sizing costs: {', '.join(bad)}")

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "algorithm": self.algorithm.value}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Costs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sizing cost keys: {', '.join(unknown)}")
        values = dict(data)
        if "algorithm" in values:
            values["algorithm"] = BroadcastAlgorithm(values["algorithm"])
        return cls(**values)


def load_costs(path: str | Path | None = None) -> Costs:
    """The costs in `path` (JSON), or the shipped reference costs."""
    source = REFERENCE_COSTS if path is None else Path(path)
    try:
        return Costs.from_dict(json.loads(source.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read sizing costs from {source}: {e}") from e
