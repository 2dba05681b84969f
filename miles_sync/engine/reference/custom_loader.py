"""SGLang's `--custom-weight-loader` on the reference engine: a tensor update whose load_format is an allow-listed
import path runs that function on every TP rank with the rank's own payload, `loader(model, named_tensors)`, once
per selected runner, as SGLang 0.5.23's `update_weights_from_tensor` does.

What the loader gets as `model` is this engine's view of one runner's engine parameters (`StagedParameters`): SGLang
hands it the model whose `get_parameter(name)` returns the fused, TP-sharded parameter itself; this engine stores
HF parts, so each parameter the loader asks for is a fresh buffer of the engine parameter's shape and dtype, and
after the loader returns every buffer it asked for is written into the runner as a direct load writes (physical
bytes, no finalize). One difference, never kinder: a parameter SGLang's loader asked for and then failed to write
keeps its old bytes there, and undefined ones here (the sync that failed holds the engine either way).

A loader that raises, or a path that does not import, ends SGLang's scheduler: `CustomLoaderFailed`, which the
engine turns into a crash.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from miles_sync.engine.reference.runner_api import StoredRunner

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine


class CustomLoaderFailed(RuntimeError):
    """The custom loader raised, or its path did not import: SGLang's scheduler dies on either."""


class StagedParameters:
    """One runner's engine parameters as a custom loader sees them (module docstring)."""

    def __init__(self, runner: StoredRunner) -> None:
        self._metas = runner.engine_parameters()
        self._staged: dict[str, torch.Tensor] = {}

    def get_parameter(self, target: str) -> torch.Tensor:
        meta = self._metas.get(target)
        if meta is None:  # as torch.nn.Module.get_parameter
            raise AttributeError(f"the model has no parameter {target!r}")
        if target not in self._staged:
            self._staged[target] = torch.empty(meta.shape, dtype=meta.dtype)
        return self._staged[target]

    def staged(self) -> list[tuple[str, torch.Tensor]]:
        return list(self._staged.items())


def import_loader(path: str) -> Callable[[Any, Sequence[tuple[str, torch.Tensor]]], Any]:
    """The function at `path` ("package.module.function"), as SGLang's `dynamic_import`."""
    module_name, _, attribute = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except Exception as exc:
        raise CustomLoaderFailed(f"cannot import {path}: {type(exc).__name__}: {exc}") from None


def run_custom_loader(
    path: str, runners: Sequence[StoredRunner], named: Sequence[tuple[str, torch.Tensor]]
) -> dict[str, list[str]]:
    """Run the loader at `path` on `named` (this rank's payload) once per runner, then write what it staged into
    that runner direct; returns the engine parameter names written, per role."""
    loader = import_loader(path)
    written = {}
    for runner in runners:
        model = StagedParameters(runner)
        try:
            loader(model, list(named))
        except Exception as exc:
            raise CustomLoaderFailed(f"{path} raised {type(exc).__name__}: {exc}") from None
        written[runner.role.value] = runner.load_direct(model.staged())
    return written
