"""Import shims that let the released SGLang 0.5.23 server start on a CPU-only x86 machine without sgl-kernel's
CPU build. Installed into the SGLang server's own venv by launch/install_sglang.sh, loaded from a `.pth` file only
when MILES_SYNC_SGLANG_CPU_SHIM=1 (the launcher sets it for CPU servers), never in miles_sync's venv.

What each shim is, and why it never touches a weight update:
- torchvision: PyPI's torchvision wheel is a CUDA build whose `_C.so` does not load next to the CPU torch; its
  `register_fake("torchvision::nms")` then raises at import because the op schema was never defined. Defining the
  two schemas (no kernels) lets `torchvision.transforms` import, which is all SGLang's config import needs. Any call
  of those ops still fails (no kernel).
- sgl_kernel: with SGLANG_USE_CPU_ENGINE=1 SGLang imports `sgl_kernel` at module level (e.g. kvcache/cache_move.py),
  and PyPI has no CPU build of it. On a CPU without AMX every op SGLang uses for a dense Qwen3 target falls back to
  torch (`cpu_has_amx_support()` is false), so the stub below is imported but never called while serving. Its
  attributes are functions that raise NotImplementedError naming the op when called: a code path that does need the
  kernel fails loudly instead of computing something else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUB_PACKAGES = ("sgl_kernel",)


def _define_torchvision_schemas() -> None:
    import torch

    library = torch.library.Library("torchvision", "DEF")  # noqa: F841 - kept alive in the module below
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    sys.modules[__name__].__dict__["_TORCHVISION_LIBRARY"] = library


class _MissingKernel:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"{self._name}: sgl-kernel has no CPU build here (import stub of the CPU shim)")

    def __getattr__(self, attribute: str) -> _MissingKernel:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _MissingKernel(f"{self._name}.{attribute}")


class _StubModule(types.ModuleType):
    def __getattr__(self, attribute: str) -> _MissingKernel:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _MissingKernel(f"{self.__name__}.{attribute}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib's signature
        if fullname.split(".")[0] not in STUB_PACKAGES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):  # noqa: ANN001
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:  # noqa: ANN001
        return None


def install() -> None:
    """Idempotent: a venv whose lib64 links to lib reads the `.pth` file twice."""
    if any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        return
    _define_torchvision_schemas()
    sys.meta_path.append(_StubFinder())  # last: a real sgl_kernel, where one is installed, wins
