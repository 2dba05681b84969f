"""CPU shims for megatron-core 0.16.x, applied only when CUDA is absent.

megatron-core builds and runs a `GPTModel` on CPU over gloo except for a few places that reach for CUDA
unconditionally. Each shim below replaces exactly that reach with its CPU equivalent; none of them changes what
a forward or backward computes:

1. `torch.cuda.current_device()` is used as a *device argument* (rotary embedding frequencies, the global memory
   buffer). Without CUDA it raises; the shim answers "cpu" so those tensors are created where the model lives.
2. `CudaRNGStatesTracker.fork()` swaps the CUDA generator state around dropout and initialization. Without CUDA
   there is no such generator; the shim forks nothing, so code inside draws from the CPU default generator.
   (`model_parallel_cuda_manual_seed` must be skipped on CPU for the same reason.)
3. `get_default_causal_mask` (and its sliding-window sibling) allocate the mask with `device="cuda"`. The shim
   builds the same boolean mask on CPU, in `transformer.utils` and in `fusions.fused_softmax`, which imported
   the names before any patch could reach them.

4. `LanguageModule.setup_embeddings_and_output_layer` moves the embedding copy of a later pipeline stage (tied
   embeddings, or MTP layers off the first stage) to CUDA right before the all-reduce that makes it equal to the
   first stage's embedding. The shim runs that method with `Tensor.cuda` as the identity, so the copy stays on
   CPU and the same all-reduce runs over gloo; outside that call `Tensor.cuda` is untouched.

Training through megatron-core's pipeline schedules (`pipeline_parallel.schedules`, `p2p_communication`) needs two
more; the collectives on that path (p2p send/recv, and all_gather_into_tensor / reduce_scatter_tensor in the MoE
allgather dispatcher, in the sequence-parallel linears and embedding, and in their backward) are all implemented by
gloo in torch 2.13, so none of them is shimmed. (Sequence parallelism needs no shim either: the local spec's torch
norm that refuses it is swapped in the model's spec, `model_builder.SequenceParallelTorchNorm`.)

5. `P2PCommunicator._communicate` calls `torch.cuda.synchronize()` after batched p2p (`batch_p2p_sync`, on by
   default) to guard against a NCCL race. Without CUDA there is no device work to wait for (the gloo requests are
   already waited on); the shim makes it a no-op instead of raising "Torch not compiled with CUDA enabled".
6. Every schedule (`forward_backward_no_pipelining`, `..._pipelining_without_interleaving`, `..._with_interleaving`)
   creates its token counter with `torch.zeros([], dtype=torch.int, device="cuda")`. The shim gives
   `schedules` a view of `torch` whose `zeros` creates `device="cuda"` tensors on CPU; every other name is torch's
   own, and no other module sees the change.

With CUDA present `apply_cpu_shims()` does nothing, so GPU runs use megatron-core untouched.

One more fallback is not about CUDA but about Transformer Engine being absent: `moe_utils` binds
`te_general_gemm` only when TE imports, yet the router's gating tests `te_general_gemm is not None`, so a local-spec
MoE forward raises NameError without TE. `define_missing_te_fallbacks()` binds it to None, which is the value that
code path already expects for "TE unavailable" (plain torch.mm). It runs wherever TE is absent, CUDA or not.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

_is_applied = False


def _current_device_cpu() -> str:
    return "cpu"


@contextlib.contextmanager
def _fork_nothing(self: object, name: str = "model-parallel-rng") -> Iterator[None]:
    yield


def _default_causal_mask_cpu(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _sliding_window_causal_mask_cpu(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def _keep_on_cpu(method):
    def wrapper(self, *args, **kwargs):
        original_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = _tensor_stays
        try:
            return method(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = original_cuda

    return wrapper


def _tensor_stays(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return self


def _synchronize_nothing(device: object = None) -> None:
    return None


class _TorchWithCpuCudaZeros(types.ModuleType):
    """`torch` as megatron-core's `schedules` module sees it (shim 6): `zeros(..., device="cuda")` lands on CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        is_cuda = device is not None and torch.device(device).type == "cuda"
        return torch.zeros(*size, device="cpu" if is_cuda else device, **kwargs)


def apply_cpu_shims() -> bool:
    """Install the shims if CUDA is unavailable. Idempotent; returns whether the shims are active.

    Call before building a megatron-core model on CPU (the model builder does). Mutates process-global state
    (`torch.cuda.current_device` and a few megatron-core attributes); never undone, because megatron-core keeps
    references to the tensors and masks created under it.
    """
    global _is_applied
    define_missing_te_fallbacks()
    if torch.cuda.is_available():
        return False
    if _is_applied:
        return True
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils

    torch.cuda.current_device = _current_device_cpu
    tp_random.CudaRNGStatesTracker.fork = _fork_nothing
    for module in (transformer_utils, fused_softmax):
        module.get_default_causal_mask = _default_causal_mask_cpu
        module.get_sliding_window_causal_mask = _sliding_window_causal_mask_cpu
    LanguageModule.setup_embeddings_and_output_layer = _keep_on_cpu(LanguageModule.setup_embeddings_and_output_layer)
    torch.cuda.synchronize = _synchronize_nothing
    schedules.torch = _TorchWithCpuCudaZeros("torch")
    _is_applied = True
    return True


def define_missing_te_fallbacks() -> None:
    """Bind `moe_utils.te_general_gemm = None` when Transformer Engine is absent (see module docstring)."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
