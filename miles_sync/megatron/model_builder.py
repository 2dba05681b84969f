"""HF config -> megatron-core `GPTModel` for the raw families (Llama, Qwen2, Qwen3, Qwen3-MoE, plus MTP layers).

The trainer builds its model here, so export and import always meet the architecture they were written for.
Needs torch.distributed and megatron-core model parallelism initialized. Layer spec: Transformer Engine when TE
and CUDA are present, else megatron-core's local spec (CPU shims applied). Sizes are the HF config's; everything
that is a training choice rather than an architecture fact can be overridden with `overrides`.

Sequence parallelism is on exactly for MoE models under tensor parallelism: megatron-core trains MoE layers under
TP only with it. The local spec's norm (`WrappedTorchNorm`, used wherever TE and apex are absent, GPU included)
refuses it, so a spec built without TE swaps it for `SequenceParallelTorchNorm`, the same torch norm without the
refusal. A swap in the spec rather than a shim in `cpu_shims`: it is a choice of module for this model, not a
CUDA reach, and nothing process-global changes (dense models still get megatron's own class).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from miles_sync.wire.text import raise_if

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe")

# Megatron-LM's default: pad the vocabulary to a multiple of 128 * TP so every shard is GEMM friendly.
DEFAULT_VOCAB_DIVISIBLE_BY = 128

# megatron-core's built-in llama3 rope scaling fixes these; other values would silently compute different RoPE.
_LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def padded_vocab_size(vocab_size: int, *, tp_size: int, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
    """Smallest multiple of divisible_by * tp_size that holds vocab_size rows."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def transformer_config_from_hf(
    hf_config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    mtp_num_layers: int | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """The megatron-core TransformerConfig of `hf_config` under the current model-parallel sizes.

    Raises ValueError naming every HF setting the raw families cannot reproduce (model type, activation,
    biases, sliding window, rope scaling). Sequence parallelism is on for MoE models under TP, off otherwise.
    """
    _check_supported(hf_config)  # before importing megatron-core: a wrong config fails fast
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    model_type = hf_config.model_type
    num_heads = int(hf_config.num_attention_heads)
    head_dim = getattr(hf_config, "head_dim", None)
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None)
    tp_size = ps.get_tensor_model_parallel_world_size()
    ep_size = ps.get_expert_model_parallel_world_size()
    fields: dict[str, Any] = dict(
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=int(hf_config.hidden_size),
        ffn_hidden_size=int(hf_config.intermediate_size),
        num_attention_heads=num_heads,
        num_query_groups=num_heads if num_kv_heads is None else int(num_kv_heads),
        kv_channels=int(hf_config.hidden_size) // num_heads if head_dim is None else int(head_dim),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_type == "qwen2",  # Qwen2 always has q/k/v biases (and no o_proj bias)
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        init_method_std=float(hf_config.initializer_range),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        # MoE under TP: MoELayer refuses to train without it. Dense models keep it off, so nothing changes for them.
        sequence_parallel=model_type == "qwen3_moe" and tp_size > 1,
        mtp_num_layers=_mtp_layers(hf_config, mtp_num_layers),
    )
    if model_type == "qwen3_moe":
        fields.update(_moe_fields(hf_config))
    if overrides is not None:
        fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt_model(
    hf_config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    mtp_num_layers: int | None = None,
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    use_transformer_engine: bool | None = None,
    overrides: Mapping[str, Any] | None = None,
    vp_stage: int | None = None,
) -> Any:
    """This rank's pipeline stage of the model `hf_config` describes, randomly initialized (megatron's init).

    `mtp_num_layers` None takes the HF config's `num_nextn_predict_layers` (0 when absent). The vocabulary is padded
    to `padded_vocab_size(...)`; exporters trim it back. Under sequence parallelism (MoE with tp > 1) every forward
    needs a sequence length divisible by tp.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from miles_sync.megatron.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    config = transformer_config_from_hf(hf_config, dtype=dtype, mtp_num_layers=mtp_num_layers, overrides=overrides)
    use_te = specs.HAVE_TE and torch.cuda.is_available() if use_transformer_engine is None else use_transformer_engine
    block_spec = specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
    )
    mtp_spec = None
    if config.mtp_num_layers:
        mtp_spec = specs.get_gpt_mtp_block_spec(config, block_spec, use_transformer_engine=use_te, vp_stage=vp_stage)
    if config.sequence_parallel and not use_te:
        # Only megatron's torch-norm fallback refuses SP; apex's FusedLayerNorm, the local norm where apex is
        # installed, accepts it and stays.
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        block_spec, mtp_spec = (
            _swap_module(s, WrappedTorchNorm, SequenceParallelTorchNorm) for s in (block_spec, mtp_spec)
        )
    rope_scaling = getattr(hf_config, "rope_scaling", None)
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=padded_vocab_size(
            int(hf_config.vocab_size),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            divisible_by=vocab_divisible_by,
        ),
        max_sequence_length=int(hf_config.max_position_embeddings),
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=float(getattr(hf_config, "rope_theta", 10000.0)),
        rope_scaling=rope_scaling is not None,
        rope_scaling_factor=float(rope_scaling["factor"]) if rope_scaling is not None else 8.0,
        mtp_block_spec=mtp_spec,
        vp_stage=vp_stage,
    )


class SequenceParallelTorchNorm:
    """megatron-core's `WrappedTorchNorm` (a plain torch LayerNorm / RMSNorm) for a sequence-parallel model.

    The torch norm normalizes each token over the hidden size, so it computes the same on a sequence shard as on
    the whole sequence; `WrappedTorchNorm` merely asserts that SP is off. Its weight (and bias) are marked
    `sequence_parallel` as TE's and apex's norms mark them: each TP rank sees only its shard's tokens, so their
    gradients must be summed over the TP group (`schedule.reduce_gradients`, megatron's `finalize_model_grads`).
    """

    def __new__(
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        # Same refusals as WrappedTorchNorm, bar sequence parallelism; the norm kind is the config's, as there.
        unsupported = [
            name
            for name in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm")
            if getattr(config, name)
        ]
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if unsupported or config.normalization not in kinds:
            raise ValueError(
                f"SequenceParallelTorchNorm: normalization={config.normalization!r} must be LayerNorm or RMSNorm, "
                f"and these torch norms support none of {unsupported}"
            )
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _swap_module(spec: Any, old: type, new: type) -> Any:
    """A copy of the spec tree `spec` (ModuleSpec, submodule dataclasses, lists) with the module class `old` replaced
    by `new` everywhere; the input is untouched (megatron-core shares one layer spec between layers)."""
    if spec is old:
        return new
    if isinstance(spec, list | tuple):
        return type(spec)(_swap_module(s, old, new) for s in spec)
    if isinstance(spec, dict):
        return {k: _swap_module(v, old, new) for k, v in spec.items()}
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _swap_module(getattr(spec, f.name), old, new) for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **changes)
    return spec


def _mtp_layers(hf_config: Any, requested: int | None) -> int | None:
    count = _config_int(hf_config, "num_nextn_predict_layers", 0) if requested is None else requested
    if count < 0:
        raise ValueError(f"mtp_num_layers={count} must be >= 0")
    return count if count > 0 else None  # megatron-core means "no MTP" by None, not 0


def _moe_fields(hf_config: Any) -> dict[str, Any]:
    num_layers = int(hf_config.num_hidden_layers)
    sparse_step = _config_int(hf_config, "decoder_sparse_step", 1)
    dense_layers = getattr(hf_config, "mlp_only_layers", None)
    dense_layers = set() if dense_layers is None else set(dense_layers)
    # Qwen3-MoE: layer i is sparse iff it is not listed dense and (i + 1) is a multiple of decoder_sparse_step.
    pattern = [0 if (i in dense_layers or (i + 1) % sparse_step != 0) else 1 for i in range(num_layers)]
    shared_size = _config_int(hf_config, "shared_expert_intermediate_size", 0)
    return dict(
        num_moe_experts=int(hf_config.num_experts),
        moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        moe_router_topk=int(hf_config.num_experts_per_tok),
        moe_layer_freq=pattern,
        # Qwen3-MoE routes by softmax over all experts, then top-k, renormalized when norm_topk_prob; megatron's
        # top-k-then-softmax equals the renormalized form, pre-softmax the plain one.
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(getattr(hf_config, "norm_topk_prob", True)),
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        # The all-to-all dispatcher creates CUDA streams at construction; allgather runs everywhere.
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=shared_size if shared_size > 0 else None,
        moe_shared_expert_gate=shared_size > 0,
    )


def _config_int(hf_config: Any, name: str, default: int) -> int:
    # HF configs carry optional sizes as absent or None alike.
    value = getattr(hf_config, name, None)
    return default if value is None else int(value)


def _check_supported(hf_config: Any) -> None:
    problems = []
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type={model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r} (only 'silu')")
    if bool(getattr(hf_config, "mlp_bias", False)):
        problems.append("mlp_bias=True")
    if model_type != "qwen2" and bool(getattr(hf_config, "attention_bias", False)):
        problems.append("attention_bias=True (it adds an o_proj bias, which megatron-core's attention lacks)")
    if bool(getattr(hf_config, "use_sliding_window", False)):
        problems.append("use_sliding_window=True")
    rope_scaling = getattr(hf_config, "rope_scaling", None)
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        fixed_mismatch = {k: rope_scaling.get(k) for k, v in _LLAMA3_ROPE_FIXED.items() if rope_scaling.get(k) != v}
        if kind != "llama3" or fixed_mismatch:
            problems.append(f"rope_scaling={rope_scaling!r} (only llama3 with {_LLAMA3_ROPE_FIXED})")
    raise_if(problems, what="cannot build a megatron-core model for this HF config")
