"""One training step of a megatron-core GPTModel stage through megatron-core's own pipeline schedule.

`forward_backward` runs `get_forward_backward_func()` (1F1B across pipeline stages, or no pipelining at pp=1)
for a token-weighted NLL loss and leaves this rank's gradients in `param.grad`; `reduce_gradients` then does what
megatron's DDP wrapper and `finalize_model_grads` do for a model that is not DDP-wrapped; `batch_totals` makes
the last stage's reported sums every rank's. The model is a bare `GPTModel` (no DDP, no `main_grad`), so the
optimizer is any torch optimizer over `model.parameters()`.

The loss is a sum, not a mean: callers fold every normalization (by the batch's token count, by advantages) into
the per-token weights, which is what makes data-parallel gradients a plain sum and every layout compute the same
update as one rank on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["batch_totals", "forward_backward", "forward_logprobs", "reduce_gradients"]


def forward_backward(
    model: torch.nn.Module,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    loss_weights: torch.Tensor,
    nll_weights: torch.Tensor,
    micro_batch_size: int,
) -> torch.Tensor:
    """Forward and backward of `sum(nll * loss_weights)` over these rows, in microbatches of `micro_batch_size`.

    All tensors are [rows, seq]; rows must be a multiple of `micro_batch_size`, and every rank of a pipeline (and,
    with expert parallelism, of the expert group) must pass the same rows x seq shape (p2p buffers and the MoE
    allgather assume it). Accumulates into `param.grad` (the caller zeroes them); nothing is reduced across
    data-parallel ranks. Returns float64 [sum(nll * loss_weights), sum(nll * nll_weights)] over these rows on the
    last pipeline stage, zeros elsewhere. Puts the model in train mode.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    num_rows, seq_length = input_ids.shape
    if num_rows % micro_batch_size:
        raise ValueError(f"{num_rows} rows are not a multiple of micro_batch_size={micro_batch_size}")
    num_microbatches = num_rows // micro_batch_size
    positions = torch.arange(seq_length, device=input_ids.device).unsqueeze(0).expand(micro_batch_size, -1)
    microbatches = [
        tuple(t[i : i + micro_batch_size] for t in (input_ids, labels, loss_weights, nll_weights))
        for i in range(0, num_rows, micro_batch_size)
    ]

    def step(data_iterator, stage):
        ids, labels_mb, loss_w, nll_w = next(data_iterator)
        # The last stage returns [mb, seq] per-token cross entropy (vocab-parallel over TP); the others, hidden states.
        # An MTP layer's own loss covers the positions the weights cover (megatron's default is every position).
        output = stage(ids, positions, None, labels=labels_mb, loss_mask=(nll_w > 0).float())

        def loss_func(nll: torch.Tensor):
            loss = (nll * loss_w).sum()
            reported = torch.stack([loss.detach(), (nll.detach() * nll_w).sum()]).double()
            # The schedule divides each microbatch's loss by their number (megatron averages microbatches); the
            # weights already normalize over the whole batch, so that division is undone here.
            return loss * num_microbatches, reported

        return output, loss_func

    model.train()
    reported = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    if not reported:  # not the last stage
        return torch.zeros(2, dtype=torch.float64, device=input_ids.device)
    return torch.stack(reported).sum(dim=0)


def forward_logprobs(
    model: torch.nn.Module,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    micro_batch_size: int,
) -> torch.Tensor:
    """Forward only: log softmax(logits / temperature)[label] at every position, float32 [rows, seq], on every
    rank of the pipeline (the last stage computes it through the vocab-parallel cross entropy and broadcasts it).

    Shapes and microbatching as `forward_backward`. No gradient is kept and no weight changes; puts the model in
    eval mode. The temperature divides the output layer's logits for the duration of the call (a forward hook), so
    the MTP logits computed alongside are scaled too; they are not returned.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    num_rows, seq_length = input_ids.shape
    if num_rows % micro_batch_size:
        raise ValueError(f"{num_rows} rows are not a multiple of micro_batch_size={micro_batch_size}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be positive")
    num_microbatches = num_rows // micro_batch_size
    positions = torch.arange(seq_length, device=input_ids.device).unsqueeze(0).expand(micro_batch_size, -1)
    microbatches = [
        (input_ids[i : i + micro_batch_size], labels[i : i + micro_batch_size])
        for i in range(0, num_rows, micro_batch_size)
    ]

    def step(data_iterator, stage):
        ids, labels_mb = next(data_iterator)
        output = stage(ids, positions, None, labels=labels_mb)

        def loss_func(nll: torch.Tensor):
            return nll.sum(), -nll.detach().float()

        return output, loss_func

    def scale(module, inputs, output):
        logits, bias = output
        return logits / temperature, bias

    output_layer = getattr(model, "output_layer", None) if ps.is_pipeline_last_stage() else None
    hook = None if output_layer is None or temperature == 1.0 else output_layer.register_forward_hook(scale)
    model.eval()
    try:
        with torch.no_grad():
            reported = get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iter(microbatches),
                model=model,
                num_microbatches=num_microbatches,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=True,
            )
    finally:
        if hook is not None:
            hook.remove()
    result = torch.cat(reported) if reported else torch.zeros(num_rows, seq_length, device=input_ids.device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            result, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
    return result


def reduce_gradients(model: torch.nn.Module) -> None:
    """Sum this rank's gradients with the ranks that hold the same parameters, as megatron-core does for a
    summed loss: dense parameters over the data-parallel group, routed-expert parameters over the
    expert-data-parallel group, over tensor parallelism the q/k layernorm weights (each TP rank normalizes only its
    own heads) and, under sequence parallelism, the parameters marked `sequence_parallel` (norms and the router: each
    TP rank sees only its sequence shard), each once as `finalize_model_grads` does, and the word embedding copies
    over the embedding group (first and last stage) when the model shares them across stages.

    Every rank of the model calls it after `forward_backward`. Mutates `param.grad`; a parameter the step did not
    reach gets a zero gradient, so every rank contributes the same buffers to each collective.
    """
    from megatron.core import parallel_state as ps

    config = model.config
    dense, expert, tp_partial = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        is_per_head = config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
        if is_per_head or (config.sequence_parallel and getattr(param, "sequence_parallel", False)):
            tp_partial.append(param.grad)
        # megatron's local linears mark routed experts `allreduce=False` only when ep > 1; with ep = 1 and etp != tp
        # the expert grid still differs from the dense one, so routed experts are also known by their module path.
        is_expert = not getattr(param, "allreduce", True) or ".mlp.experts." in name
        (expert if is_expert else dense).append(param.grad)
    _all_reduce_sum(tp_partial, group=ps.get_tensor_model_parallel_group())
    _all_reduce_sum(dense, group=ps.get_data_parallel_group())
    _all_reduce_sum(expert, group=ps.get_expert_data_parallel_group())
    is_shared = model.share_embeddings_and_output_weights or bool(config.mtp_num_layers)
    embedding_group = ps.get_embedding_group(check_initialized=False)
    if is_shared and embedding_group is not None and dist.get_rank() in dist.get_process_group_ranks(embedding_group):
        weight = model.shared_embedding_or_output_weight()
        if weight.requires_grad:  # frozen under LoRA: no gradient to share
            _all_reduce_sum([weight.grad], group=embedding_group)


def batch_totals(local: torch.Tensor) -> torch.Tensor:
    """The last stage's sums from `forward_backward`, summed over data-parallel ranks, on every rank (the last
    stage broadcasts them to its pipeline). Every rank calls it; returns a new tensor."""
    from megatron.core import parallel_state as ps

    totals = local.clone()
    if ps.is_pipeline_last_stage():
        _all_reduce_sum([totals], group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            totals, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
    return totals


def _all_reduce_sum(tensors: list[torch.Tensor], *, group: dist.ProcessGroup | None) -> None:
    # One all-reduce per dtype (a bf16 model keeps fp32 norms); every member passes the same list in the same order.
    if not tensors or group is None or dist.get_world_size(group) == 1:
        return
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        for tensor, synced in zip(same, flat.split([t.numel() for t in same]), strict=True):
            tensor.copy_(synced.view_as(tensor))
