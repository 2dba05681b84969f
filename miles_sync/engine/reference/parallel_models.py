"""Tensor-parallel models of the reference engine: one rank's slice of a causal LM or an MTP head, computing the
full logits and hidden states with collectives over the engine-internal group, as SGLang's parallel layers do.

Split rules are SGLang's, written once in `miles_sync.weights.engine_layout`:

- q/k/v and gate/up are column-parallel: the rank's module is transformers' own, built from a rank-local config
  (heads, KV heads and intermediate size divided by tp; KV heads replicated when fewer than the ranks).
- o_proj and down_proj are row-parallel: local input columns, partial outputs summed over the group; a bias is added
  once, on rank 0, before the sum (SGLang's RowParallelLinear).
- embed_tokens and lm_head are vocab-parallel over the vocabulary padded to a multiple of 64: ids outside the rank's
  rows embed to zeros before the sum; local logits are gathered, concatenated and cut back to the real vocabulary.
- norms and the MTP head's enorm/hnorm/eh_proj are replicated.

Every rank computes the same full logits and hidden states. Collectives run over `group` (None: the default
group) and must be issued in the same order on every rank: call `forward` on all ranks together. With tp_size 1 no
collective runs and no process group is needed. The runner storing these models' weights is `sharded.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from miles_sync.engine.reference.models import (
    CausalLM,
    LMOutput,
    MTPHead,
    config_dtype,
    model_family,
    mtp_forward,
)
from miles_sync.weights.engine_layout import (
    ShardKind,
    TPShape,
    shard_kind,
    tp_problems,
)
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.text import raise_if

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

_ATTENTION = "sdpa"  # as models.CausalLM

# ---- parallel layers --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _TPGroup:
    """This rank's place in its TP group and the two collectives the parallel layers use."""

    tp_rank: int
    tp_size: int
    group: Any  # torch.distributed.ProcessGroup | None (the default group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dim, in rank order."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _tp_group(*, tp_rank: int, tp_size: int, group: Any) -> _TPGroup:
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    if tp_size > 1:
        if not dist.is_initialized():
            raise ValueError(f"tp_size={tp_size} needs an initialized torch.distributed process group")
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (tp_size, tp_rank):
            raise ValueError(
                f"the process group has world size {size} and this process is its rank {rank}, "
                f"expected tp_size={tp_size} and tp_rank={tp_rank}"
            )
    return _TPGroup(tp_rank=tp_rank, tp_size=tp_size, group=group)


class _RowParallelLinear(nn.Linear):
    """Local input columns; partial outputs summed over the group; the bias added once (rank 0) before the sum."""

    def __init__(self, linear: nn.Linear, *, tp: _TPGroup) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self._tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self._tp.tp_rank == 0 else None
        return self._tp.all_reduce(F.linear(x, self.weight, bias))


class _VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the padded vocabulary; other ids embed to zeros before the sum."""

    def __init__(self, num_rows: int, hidden_size: int, *, tp: _TPGroup) -> None:
        super().__init__(num_rows, hidden_size)
        self._start = tp.tp_rank * num_rows
        self._tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self._start
        is_local = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.masked_fill(~is_local, 0), self.weight)
        return self._tp.all_reduce(out.masked_fill(~is_local[..., None], 0))


class _ParallelLMHead(nn.Linear):
    """Logits of the rank's vocabulary rows, gathered from every rank and cut to the real vocabulary."""

    def __init__(self, hidden_size: int, num_rows: int, *, vocab_size: int, bias: bool, tp: _TPGroup) -> None:
        super().__init__(hidden_size, num_rows, bias=bias)
        self._vocab_size = vocab_size
        self._tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._tp.all_gather_last(F.linear(hidden, self.weight, self.bias))
        return logits[..., : self._vocab_size]


def _parallelize_rows(root: nn.Module, *, tp: _TPGroup) -> None:
    """Swap every row-parallel nn.Linear under `root` (o_proj, down_proj) for a `_RowParallelLinear` that keeps its
    parameters (same names, same tensors)."""
    for name, module in list(root.named_modules()):
        if isinstance(module, nn.Linear) and shard_kind(f"{name}.weight") is ShardKind.ROW:
            parent, _, child = name.rpartition(".")
            setattr(root.get_submodule(parent), child, _RowParallelLinear(module, tp=tp))


def rank_config(config, *, tp_size: int):
    """A copy of the full HF config with this rank's share of the split dimensions: heads, KV heads (at least one),
    intermediate size, vocabulary (padded, per rank); head_dim is set explicitly to the full model's. ValueError
    naming every dimension when the shape does not split at `tp_size`."""
    shape = TPShape.from_config(config)
    problems = tp_problems(shape, tp_size)
    raise_if(problems, what=f"cannot split a {config.model_type} model at tp_size={tp_size}")
    local = copy.deepcopy(config)
    local.num_attention_heads = shape.num_attention_heads // tp_size
    local.num_key_value_heads = shape.kv_heads_per_rank(tp_size)
    local.intermediate_size = shape.intermediate_size // tp_size
    local.head_dim = shape.head_dim
    local.vocab_size = shape.padded_vocab_size // tp_size
    local.pad_token_id = None  # a padding row only matters to gradients, and it may fall outside the local rows
    local._attn_implementation = _ATTENTION
    return local


def _full_config(config):
    full = copy.deepcopy(config)
    full._attn_implementation = _ATTENTION
    return full


def _metas(params: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
    return {name: TensorMeta(name=name, shape=tuple(p.shape), dtype=p.dtype) for name, p in params.items()}


# ---- models -----------------------------------------------------------------------------------------------------


class ShardedCausalLM(nn.Module):
    """Rank `tp_rank` of `tp_size` of transformers' `*ForCausalLM` for the config's family (see the module docstring).

    `config` is the FULL HF config; `hf_parameters()` are this rank's local tensors under their HF names; forward
    returns the full logits [B, L, vocab] and hidden [B, L, H] on every rank, as `models.CausalLM.forward`.
    """

    def __init__(self, config, *, tp_rank: int, tp_size: int, group: Any = None) -> None:
        super().__init__()
        self._tp = _tp_group(tp_rank=tp_rank, tp_size=tp_size, group=group)
        self.family = model_family(config.model_type)
        self.config = _full_config(config)
        self.shape = TPShape.from_config(config)
        num_rows, hidden_size = self.shape.padded_vocab_size // tp_size, self.shape.hidden_size
        # Initial values are placeholders until a load; the caller's random stream is left alone.
        with torch.random.fork_rng(devices=[]):
            self.hf = self.family.causal_lm_class(rank_config(config, tp_size=tp_size))
            self.hf.model.embed_tokens = _VocabParallelEmbedding(num_rows, hidden_size, tp=self._tp)
            self.hf.lm_head = _ParallelLMHead(
                hidden_size,
                num_rows,
                vocab_size=self.shape.vocab_size,
                bias=self.hf.lm_head.bias is not None,
                tp=self._tp,
            )
        _parallelize_rows(self.hf, tp=self._tp)
        if getattr(config, "tie_word_embeddings", False):
            self.hf.lm_head.weight = self.hf.model.embed_tokens.weight
        self.hf.to(config_dtype(config))

    @property
    def tp_rank(self) -> int:
        return self._tp.tp_rank

    @property
    def tp_size(self) -> int:
        return self._tp.tp_size

    @property
    def embed_tokens(self) -> nn.Module:
        return self.hf.model.embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        return self.hf.lm_head

    def hf_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.hf.named_parameters())

    def full_parameter_metas(self) -> dict[str, TensorMeta]:
        """HF name -> shape and dtype of the unsharded tensor (an unsharded twin built on the meta device)."""
        with torch.device("meta"):
            return _metas(CausalLM(self.config).hf_parameters())

    def forward(self, input_ids: torch.Tensor) -> LMOutput:
        hidden = self.hf.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return LMOutput(logits=self.hf.lm_head(hidden), hidden=hidden)


class ShardedMTPHead(nn.Module):
    """Rank `tp_rank` of `tp_size` of `models.MTPHead`: the same HF names under `model.layers.N.`; enorm, hnorm,
    eh_proj and shared_head.norm replicated, the decoder layer sharded as the target's."""

    def __init__(self, config, *, tp_rank: int, tp_size: int, group: Any = None) -> None:
        super().__init__()
        self._tp = _tp_group(tp_rank=tp_rank, tp_size=tp_size, group=group)
        self.family = model_family(config.model_type)
        self.config = _full_config(config)
        self.shape = TPShape.from_config(config)
        self.layer_index = config.num_hidden_layers
        hidden_size, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = self.family.norm_class(hidden_size, eps=eps)
        self.hnorm = self.family.norm_class(hidden_size, eps=eps)
        with torch.random.fork_rng(devices=[]):  # placeholders until a load
            self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
            # layer_idx only indexes a KV cache; 0 keeps per-layer config lists (layer_types) in range.
            self.layer = self.family.decoder_layer_class(rank_config(config, tp_size=tp_size), layer_idx=0)
        self.shared_head = nn.Module()
        self.shared_head.norm = self.family.norm_class(hidden_size, eps=eps)
        _parallelize_rows(self, tp=self._tp)
        self.rotary = self.family.rotary_class(config=self.config)
        self.to(config_dtype(config))

    @property
    def tp_rank(self) -> int:
        return self._tp.tp_rank

    @property
    def tp_size(self) -> int:
        return self._tp.tp_size

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.layer_index}."

    def hf_name(self, local_name: str) -> str:
        return self.prefix + local_name.removeprefix("layer.")

    def hf_parameters(self) -> dict[str, nn.Parameter]:
        return {self.hf_name(name): p for name, p in self.named_parameters()}

    def full_parameter_metas(self) -> dict[str, TensorMeta]:
        with torch.device("meta"):
            return _metas(MTPHead(self.config).hf_parameters())

    def forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, *, embed_tokens: nn.Module, lm_head: nn.Module
    ) -> LMOutput:
        """As `MTPHead.forward`, with the target's vocab-parallel embed_tokens and lm_head of this rank."""
        return mtp_forward(self, next_ids, hidden, embed_tokens=embed_tokens, lm_head=lm_head)
