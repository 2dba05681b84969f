"""Reference forward of a megatron-core GPTModel across pipeline stages, for parity checks (not for training).

Each stage runs its layers and hands its hidden states to the next stage with gloo/NCCL send/recv; the last stage
returns logits gathered over tensor parallelism. One micro-batch, no gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist


def megatron_logits(model: torch.nn.Module, input_ids: torch.Tensor, *, timeout_s: float) -> torch.Tensor | None:
    """Logits [batch, seq, padded_vocab] on every rank of the last pipeline stage; None on other stages.

    Every rank of the model-parallel group calls this with the same `input_ids` ([batch, seq] int64).
    Puts the model in eval mode.
    """
    from megatron.core import parallel_state as ps

    model.eval()
    config = model.config
    batch, seq = input_ids.shape
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    timeout = timedelta(seconds=timeout_s)
    is_first, is_last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    with torch.no_grad(), _main_path_only(model):
        if not is_first:
            # Hidden states travel [seq, batch, hidden], split along seq under sequence parallelism.
            local_seq = seq // ps.get_tensor_model_parallel_world_size() if config.sequence_parallel else seq
            hidden = torch.empty(local_seq, batch, config.hidden_size, dtype=config.params_dtype)
            dist.irecv(hidden, src=ps.get_pipeline_model_parallel_prev_rank()).wait(timeout=timeout)
            model.set_input_tensor(hidden)
        output = model(input_ids, position_ids, None, runtime_gather_output=True)
        if not is_last:
            dist.isend(output.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank()).wait(timeout=timeout)
            return None
        return output


@contextlib.contextmanager
def _main_path_only(model: torch.nn.Module) -> Iterator[None]:
    # megatron-core 0.16.1 cannot run an MTP model's forward without labels (it clones labels=None); logits of the
    # main model do not depend on the MTP layers, so they are switched off for this call and restored after.
    if not getattr(model, "mtp_process", False) and model.config.mtp_num_layers is None:
        yield
        return
    saved = (model.mtp_process, model.config.mtp_num_layers)
    model.mtp_process, model.config.mtp_num_layers = False, None
    try:
        yield
    finally:
        model.mtp_process, model.config.mtp_num_layers = saved
