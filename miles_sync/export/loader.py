"""Import direction: an HF checkpoint directory (config.json + safetensors) -> this rank's megatron-core shard.

Every rank reads only what its own parameters need: its pipeline stage's layers, its own experts, and for a
tensor-parallel parameter only its rows or columns (safetensors slices). No collectives. Export after import
reproduces the checkpoint's tensors bit for bit (same dtype).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from miles_sync.export.converter import Converter
from miles_sync.export.megatron import model_chunks
from miles_sync.export.stage import ParallelCoords, ParamPlan, collect_local_params, plan_local_params
from miles_sync.wire.text import raise_if

_INDEX = "model.safetensors.index.json"


class CheckpointReader:
    """Lazy, sliced reads from the safetensors files of one HF checkpoint directory. Use as a context manager."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self._file_of = _weight_map(self.checkpoint_dir)
        self._open: dict[str, object] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._open.clear()  # safe_open handles close when dropped

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        """Tensor `name`, or its slice [start, stop) along dim 0 or 1."""
        view = self._handle(name).get_slice(name)
        if dim is None:
            return view[:]
        if dim == 0:
            return view[start:stop]
        if dim == 1:
            return view[:, start:stop]
        raise AssertionError(f"slicing along dim {dim}")

    def _handle(self, name: str):
        from safetensors import safe_open

        file = self._file_of[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.checkpoint_dir / file), framework="pt")
        return self._open[file]


def load_hf_checkpoint(
    model: torch.nn.Module | Sequence[torch.nn.Module], checkpoint_dir: str | Path, *, converter: Converter
) -> int:
    """Overwrite every parameter of this rank's model chunks from `checkpoint_dir`; returns how many were written.

    Mutates the model in place (`param.data`), casting to each parameter's dtype. Raises ValueError naming every
    HF tensor the model needs that the checkpoint lacks or holds with another shape; nothing is written then.
    Other ranks need not call it at the same time.
    """
    chunks = model_chunks(model)
    coords = ParallelCoords.from_parallel_state()
    plans = plan_local_params(collect_local_params(chunks), converter=converter, coords=coords)
    params = {(i, name): p for i, chunk in enumerate(chunks) for name, p in chunk.named_parameters()}
    with CheckpointReader(checkpoint_dir) as reader:
        _check_present(plans, reader)
        with torch.no_grad():
            for plan in plans:
                param = params[(plan.param.chunk, plan.param.local_name)]
                is_expert = plan.param.is_expert
                shard = converter.read_shard(
                    plan.mapping,
                    reader.read,
                    partition_dim=plan.param.partition_dim,
                    rank=coords.etp_rank if is_expert else coords.tp_rank,
                    size=coords.etp_size if is_expert else coords.tp_size,
                    dtype=param.dtype,
                )
                assert tuple(shard.shape) == tuple(param.shape), (plan.param.local_name, shard.shape, param.shape)
                param.data.copy_(shard)
    return len(plans)


def _check_present(plans: Sequence[ParamPlan], reader: CheckpointReader) -> None:
    missing, wrong = [], []
    for plan in plans:
        for name, shape in zip(plan.mapping.hf_names, plan.mapping.hf_shapes, strict=True):
            if name not in reader:
                missing.append(name)
            elif reader.shape(name) != tuple(shape):
                wrong.append(f"{name} has shape {list(reader.shape(name))}, model needs {list(shape)}")
    problems = []
    if missing:
        problems.append(f"missing tensors {sorted(set(missing))}")
    if wrong:
        problems.append("; ".join(sorted(set(wrong))))
    raise_if(problems, what=f"checkpoint {reader.checkpoint_dir} does not fit the model")


def _weight_map(checkpoint_dir: Path) -> dict[str, str]:
    index = checkpoint_dir / _INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(p.name for p in checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint {checkpoint_dir} has neither {_INDEX} nor *.safetensors files")
    from safetensors import safe_open

    file_of = {}
    for file in files:
        with safe_open(str(checkpoint_dir / file), framework="pt") as handle:
            for name in handle.keys():
                file_of[name] = file
    return file_of
