"""Model definitions the reference engine serves: small HF-architecture causal LMs and a DeepSeek-V3-style MTP head.

HF parameter names are the loading contract. A causal LM is transformers' own `*ForCausalLM` built from a local
config (Llama, Qwen2, Qwen3, Qwen3-MoE; no hub access), so its `named_parameters()` are exactly the checkpoint's names.

MoE blocks (Qwen3-MoE's `mlp.experts.<e>.{gate,up,down}_proj`, router `mlp.gate`): `stack_expert_weights` repoints
each expert's weights at two stacked buffers per block, SGLang's FusedMoE storage (`w13_weight` [E, 2I, H], gate
rows then up rows per expert; `w2_weight` [E, H, I]). The expert modules keep their HF names and compute on views
of those buffers, so a load by HF name writes the expert's slice and the forward is transformers' own.

The MTP head lives in the TARGET checkpoint under layer index N = num_hidden_layers, named as a Megatron MTP
exporter emits it:

    model.layers.N.enorm.weight              norm of the embedding of token x_{t+1}
    model.layers.N.hnorm.weight              norm of the target's final hidden state h_t
    model.layers.N.eh_proj.weight            [hidden, 2*hidden]; input cat([enorm(e), hnorm(h)], -1), embedding first
    model.layers.N.<decoder layer names>     one decoder layer of the family (input_layernorm, self_attn.*, ...)
    model.layers.N.shared_head.norm.weight   the head's own final norm before the shared lm_head

It shares the target's `model.embed_tokens.weight` and `lm_head.weight`, which it does not own: they are passed to
`MTPHead.forward` by the caller. Position i of the head reads (x_{i+1}, h_i) and predicts x_{i+2}.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from miles_sync.wire.dtypes import config_dtype

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

# model_type -> (transformers module, class-name stem); the stem names Config, ForCausalLM, DecoderLayer, ...
_FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe"),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES)
MOE_MODEL_TYPES: tuple[str, ...] = ("qwen3_moe",)  # families with routed experts (served at TP=1 only)


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """The transformers classes of one architecture."""

    model_type: str
    config_class: type
    causal_lm_class: type
    decoder_layer_class: type
    norm_class: type
    rotary_class: type


def model_family(model_type: str) -> ModelFamily:
    """Classes for `model_type` ("llama", "qwen2", "qwen3", "qwen3_moe"), imported on first use."""
    entry = _FAMILIES.get(model_type)
    if entry is None:
        raise ValueError(f"model_type {model_type!r} is not supported; expected one of {', '.join(_FAMILIES)}")
    module_name, stem = entry
    module = importlib.import_module(module_name)
    config_module = importlib.import_module(module_name.replace(".modeling_", ".configuration_"))
    return ModelFamily(
        model_type=model_type,
        config_class=getattr(config_module, f"{stem}Config"),
        causal_lm_class=getattr(module, f"{stem}ForCausalLM"),
        decoder_layer_class=getattr(module, f"{stem}DecoderLayer"),
        norm_class=getattr(module, f"{stem}RMSNorm"),
        rotary_class=getattr(module, f"{stem}RotaryEmbedding"),
    )


def read_config(path: str | os.PathLike):
    """The transformers config of a checkpoint directory (its config.json), without touching the hub."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"checkpoint directory {str(path)!r} has no config.json")
    with open(config_path) as f:
        model_type = json.load(f).get("model_type")
    return model_family(model_type).config_class.from_json_file(str(config_path))


def num_mtp_layers(config) -> int:
    """MTP layers the checkpoint carries, DeepSeek-V3's `num_nextn_predict_layers` (0 when absent)."""
    value = getattr(config, "num_nextn_predict_layers", None)
    return 0 if value is None else int(value)


def mtp_prefix(config) -> str:
    """Name prefix of the (single) MTP layer: `model.layers.{num_hidden_layers}.`."""
    return f"model.layers.{config.num_hidden_layers}."


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of `path/model.safetensors` (or of the file `path` itself)."""
    from safetensors.torch import load_file

    file = Path(path)
    if file.is_dir():
        file = file / "model.safetensors"
    if not file.is_file():
        raise ValueError(f"no safetensors file at {str(file)!r}")
    return load_file(str(file))


class TextCodec:
    """Text <-> token ids through a checkpoint's HF tokenizer (special tokens added on encode as the tokenizer
    defines, skipped on decode, as SGLang does by default)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


def load_tokenizer(path: str | os.PathLike) -> TextCodec | None:
    """The tokenizer saved in a checkpoint directory, or None when it has none (prompts must be token ids)."""
    path = Path(path)
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return None
    from transformers import AutoTokenizer

    return TextCodec(AutoTokenizer.from_pretrained(str(path), local_files_only=True))


def linear_weight_names(module: nn.Module, *, prefix: str = "") -> Iterator[str]:
    """Names of the weights of every nn.Linear under `module`: the tensors a layout transform may rewrite. An MoE
    router (`mlp.gate`) is left out: SGLang's AITER path shuffles only the expert weights of an MoE block."""
    routers = {id(block.gate) for _, block in _moe_blocks(module)}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear) and id(sub) not in routers:
            yield f"{prefix}{name}.weight" if name else f"{prefix}weight"


def _moe_blocks(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, block) of every sparse MoE block under `module`: an `experts` ModuleList beside a `gate` router."""
    for name, sub in module.named_modules():
        if isinstance(getattr(sub, "experts", None), nn.ModuleList) and isinstance(
            getattr(sub, "gate", None), nn.Linear
        ):
            yield name, sub


@dataclass(frozen=True, kw_only=True)
class ExpertStorage:
    """The stacked expert weights of one MoE block: `w13` [E, 2I, H] (expert e's gate rows [0, I), up rows [I, 2I))
    and `w2` [E, H, I]; `prefix` is the block's experts' name prefix (`model.layers.0.mlp.experts.`)."""

    prefix: str
    w13: torch.Tensor
    w2: torch.Tensor


def stack_expert_weights(module: nn.Module) -> list[ExpertStorage]:
    """Move the expert weights of every MoE block under `module` into stacked buffers (values kept) and make each
    expert's gate/up/down weight a view of its slice; returns the buffers, in module order. Mutates `module`.

    Call after any dtype or device move: `module.to` replaces parameter data and would break the views.
    """
    stacked = []
    for name, block in _moe_blocks(module):
        experts = list(block.experts)
        with torch.no_grad():
            w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
            w2 = torch.stack([e.down_proj.weight for e in experts])
        size = experts[0].gate_proj.weight.shape[0]
        for index, expert in enumerate(experts):
            expert.gate_proj.weight.data = w13[index, :size]
            expert.up_proj.weight.data = w13[index, size:]
            expert.down_proj.weight.data = w2[index]
        stacked.append(ExpertStorage(prefix=f"{name}.experts." if name else "experts.", w13=w13, w2=w2))
    return stacked


def causal_mask(length: int, *, dtype: torch.dtype) -> torch.Tensor:
    """Additive causal mask [1, 1, L, L] (0 on and below the diagonal, dtype min above), valid for eager and sdpa.

    A standalone decoder layer gets no mask from a parent model; without one, sdpa and eager attend to the future.
    """
    mask = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return mask[None, None]


def _with_attention(config, implementation: str = "sdpa"):
    config = copy.deepcopy(config)
    config._attn_implementation = implementation
    return config


@dataclass(frozen=True, kw_only=True)
class LMOutput:
    """logits [B, L, vocab] and the final (normed) hidden state [B, L, hidden] at every position."""

    logits: torch.Tensor
    hidden: torch.Tensor


class CausalLM(nn.Module):
    """transformers' `*ForCausalLM` for the config's family; its `named_parameters()` are the HF names.

    Inputs are right-padded batches: with a purely causal mask, real positions never attend to the padding that
    follows them, so no attention mask is needed and outputs at real positions equal the unpadded ones.
    """

    def __init__(self, config, *, seed: int | None = None) -> None:
        super().__init__()
        self.family = model_family(config.model_type)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self.hf = self.family.causal_lm_class(_with_attention(config))
        self.hf.to(config_dtype(config))
        self.config = self.hf.config

    def hf_parameters(self) -> dict[str, nn.Parameter]:
        # The wrapper attribute `hf.` is not part of the HF name.
        return dict(self.hf.named_parameters())

    def linear_weight_names(self) -> frozenset[str]:
        return frozenset(linear_weight_names(self.hf))

    def stack_expert_weights(self) -> list[ExpertStorage]:
        """`stack_expert_weights` over this model; prefixes are HF names."""
        return stack_expert_weights(self.hf)

    def shared_modules(self) -> dict[str, nn.Module]:
        """The embedding and lm_head an MTP head shares with this model, as `MTPHead.forward` keyword arguments."""
        return {"embed_tokens": self.hf.model.embed_tokens, "lm_head": self.hf.lm_head}

    def forward(self, input_ids: torch.Tensor) -> LMOutput:
        hidden = self.hf.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return LMOutput(logits=self.hf.lm_head(hidden), hidden=hidden)


class MTPHead(nn.Module):
    """One DeepSeek-V3-style multi-token-prediction layer (see the module docstring for names and inputs)."""

    def __init__(self, config, *, seed: int | None = None) -> None:
        super().__init__()
        self.family = model_family(config.model_type)
        self.config = _with_attention(config)
        self.layer_index = config.num_hidden_layers
        hidden_size = config.hidden_size
        dtype = config_dtype(config)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self.enorm = self.family.norm_class(hidden_size, eps=config.rms_norm_eps)
            self.hnorm = self.family.norm_class(hidden_size, eps=config.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
            # layer_idx only indexes a KV cache; 0 keeps per-layer config lists (layer_types) in range.
            self.layer = self.family.decoder_layer_class(self.config, layer_idx=0)
            self.shared_head = nn.Module()
            self.shared_head.norm = self.family.norm_class(hidden_size, eps=config.rms_norm_eps)
            _init_like_hf(self, std=config.initializer_range)
        self.rotary = self.family.rotary_class(config=self.config)
        self.to(dtype)

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.layer_index}."

    def hf_name(self, local_name: str) -> str:
        # The decoder layer's parameters sit directly under model.layers.N., as in the checkpoint.
        return self.prefix + local_name.removeprefix("layer.")

    def hf_parameters(self) -> dict[str, nn.Parameter]:
        return {self.hf_name(name): p for name, p in self.named_parameters()}

    def linear_weight_names(self) -> frozenset[str]:
        return frozenset(self.hf_name(name) for name in linear_weight_names(self))

    def stack_expert_weights(self) -> list[ExpertStorage]:
        """`stack_expert_weights` over this head; prefixes are HF names (`model.layers.N.mlp.experts.`)."""
        return [dataclasses.replace(s, prefix=self.hf_name(s.prefix)) for s in stack_expert_weights(self)]

    def forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, *, embed_tokens: nn.Embedding, lm_head: nn.Linear
    ) -> LMOutput:
        """next_ids [B, L] (x_{i+1}) and target hidden [B, L, H] (h_i) -> prediction of x_{i+2} at each i.

        Returns logits from the shared lm_head and the head's own normed hidden, which a recurrent draft feeds back
        as h for its next step. Right-padded batches are exact at real positions (causal mask).
        """
        return mtp_forward(self, next_ids, hidden, embed_tokens=embed_tokens, lm_head=lm_head)


def mtp_forward(
    head: nn.Module, next_ids: torch.Tensor, hidden: torch.Tensor, *, embed_tokens: nn.Module, lm_head: nn.Module
) -> LMOutput:
    """One MTP step of `head` (an `MTPHead`, or one TP rank's `parallel_models.ShardedMTPHead`, which has the same
    modules: enorm, hnorm, eh_proj, layer, rotary, shared_head.norm); see `MTPHead.forward`."""
    length = next_ids.shape[1]
    embeds = embed_tokens(next_ids)
    x = head.eh_proj(torch.cat([head.enorm(embeds), head.hnorm(hidden)], dim=-1))
    position_ids = torch.arange(length, device=x.device)[None].expand(x.shape[0], length)
    x = head.layer(
        x,
        attention_mask=causal_mask(length, dtype=x.dtype),
        position_ids=position_ids,
        position_embeddings=head.rotary(x, position_ids),
    )
    if isinstance(x, tuple):  # older transformers return (hidden, ...)
        x = x[0]
    out = head.shared_head.norm(x)
    return LMOutput(logits=lm_head(out), hidden=out)


def _init_like_hf(module: nn.Module, *, std: float) -> None:
    """Normal(0, std) linears, unit norms: the HF initialisation, so an untrained head behaves like an HF layer."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, std=std)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif hasattr(sub, "weight") and isinstance(sub.weight, nn.Parameter) and sub.weight.dim() == 1:
            nn.init.ones_(sub.weight)
