"""One tensor-parallel rank of the reference engine: its slice of each model, and a runner whose storage is the
engine's own fused parameters on this rank. Each TP rank is its own process, as in SGLang.

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
collective runs and no process group is needed.

Storage (`ShardedRunner`): the physical tensors are the fused engine parameters (`...self_attn.qkv_proj.weight` =
cat(q, k, v slices), `...mlp.gate_up_proj.weight` = cat(gate, up slices), every other tensor under its HF name), the
tensors SGLang's weights checker hashes. A load receives FULL HF tensors and copies this rank's slice into its
region of the fused parameter. Compute views follow `runner.Runner`: an unshuffled fused weight's q/k/v parameters
are views of its rows (a load is live at once); a shuffled one keeps its own compute buffers, decoded with the
layout's `undo` at each finalize.
"""

from __future__ import annotations

import copy
import os
import threading
import types
from collections.abc import Iterable, Mapping
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
    causal_mask,
    config_dtype,
    model_family,
    mtp_prefix,
    num_mtp_layers,
    read_config,
    read_safetensors,
)
from miles_sync.engine.reference.runner import DRAFT_KINDS
from miles_sync.weights.checksum import sglang_parameter_names
from miles_sync.weights.engine_layout import (
    ShardKind,
    TPShape,
    is_linear_weight,
    shard_kind,
    shard_tensor,
    tp_problems,
)
from miles_sync.weights.layout import WeightLayout, layout_spec
from miles_sync.wire.bucket import TensorMeta
from miles_sync.wire.protocol import Role
from miles_sync.wire.text import shorten

__all__ = [
    "ShardedCausalLM",
    "ShardedMTPHead",
    "ShardedRunner",
    "load_sharded_runners",
    "rank_config",
]

_ATTENTION = "sdpa"  # as models.CausalLM
_NUM_SHOWN = 5  # how many missing checkpoint tensors an error message lists


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
    if problems:
        raise ValueError(f"cannot split a {config.model_type} model at tp_size={tp_size}: " + "; ".join(problems))
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
        length = next_ids.shape[1]
        embeds = embed_tokens(next_ids)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        position_ids = torch.arange(length, device=x.device)[None].expand(x.shape[0], length)
        x = self.layer(
            x,
            attention_mask=causal_mask(length, dtype=x.dtype),
            position_ids=position_ids,
            position_embeddings=self.rotary(x, position_ids),
        )
        if isinstance(x, tuple):  # older transformers return (hidden, ...)
            x = x[0]
        out = self.shared_head.norm(x)
        return LMOutput(logits=lm_head(out), hidden=out)


# ---- runner -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class _Part:
    """One HF tensor's share of an engine parameter: dim-0 rows [start, end) of it, and its compute parameter."""

    hf_name: str
    engine_name: str
    start: int
    end: int
    param: nn.Parameter
    is_whole: bool  # the engine parameter holds this tensor alone


class ShardedRunner:
    """One served model of one role on one TP rank, with the engine's fused parameters as its storage.

    Same duck interface as `runner.Runner` for the engine; names in `load`/`finalize`/`owned_names`/`expected` are
    FULL HF names, names in `stored_tensors`/`shuffled_names`/`overwrite` are engine names. All writes happen under
    `weights_lock`, which the caller holds during every forward step.
    """

    def __init__(
        self,
        *,
        role: Role,
        model: ShardedCausalLM | ShardedMTPHead,
        layout: WeightLayout = WeightLayout.NONE,
        weights_lock: threading.RLock | None = None,
    ) -> None:
        self.role = Role(role)
        self.model = model.eval().requires_grad_(False)
        self.layout = WeightLayout(layout)
        self._layout_spec = layout_spec(self.layout)
        self.weights_lock = threading.RLock() if weights_lock is None else weights_lock
        self.tp_rank, self.tp_size = model.tp_rank, model.tp_size
        self.shape = model.shape
        params = model.hf_parameters()
        self._full = model.full_parameter_metas()
        assert self._full.keys() == params.keys(), "sharded and unsharded models disagree on names"
        self._stored: dict[str, torch.Tensor] = {}
        self._parts: dict[str, tuple[_Part, ...]] = {}
        shuffled = set()
        for engine_name, hf_names in sorted(sglang_parameter_names(params).items()):
            parts = tuple(_parts(engine_name, [(name, params[name]) for name in hf_names]))
            stored = parts[0].param.detach() if len(parts) == 1 else torch.cat([p.param.detach() for p in parts])
            if is_linear_weight(engine_name) and self._layout_spec.applies_to(tuple(stored.shape), stored.dtype):
                shuffled.add(engine_name)
                # A shuffled weight needs its own physical buffer (a fused one has it already).
                stored = stored.clone() if len(parts) == 1 else stored
            elif len(parts) > 1:
                for part in parts:  # the compute view IS the fused storage: a load is live at once
                    part.param.data = stored[part.start : part.end]
            self._stored[engine_name] = stored
            self._parts[engine_name] = parts
        self._part_of = {part.hf_name: part for parts in self._parts.values() for part in parts}
        self._shuffled = frozenset(shuffled)
        self._linear = frozenset(name for name in self._stored if is_linear_weight(name))
        self._loaded: set[str] = set()
        self._epoch = 0

    # ---- what this runner owns ------------------------------------------------------------------------------

    @property
    def is_mtp(self) -> bool:
        return isinstance(self.model, ShardedMTPHead)

    @property
    def weights_epoch(self) -> int:
        """Increases on every load and finalize: anything computed from the weights at an older epoch is stale."""
        return self._epoch

    def owned_names(self) -> frozenset[str]:
        """FULL HF names this runner loads; every other name in a payload is skipped by `load`."""
        return frozenset(self._full)

    def expected(self, name: str) -> TensorMeta:
        """The FULL HF shape and dtype of `name`, what a trainer sends (every rank receives the whole tensor)."""
        meta = self._full.get(name)
        if meta is None:
            raise ValueError(f"{self.role} runner does not own tensor {name!r}")
        return meta

    def engine_parts(self) -> dict[str, tuple[str, ...]]:
        """{engine parameter name: the HF names it fuses, in row order}."""
        return {name: tuple(part.hf_name for part in parts) for name, parts in self._parts.items()}

    def shuffled_names(self) -> frozenset[str]:
        """Engine names stored in the runner's layout after finalize (empty with WeightLayout.NONE)."""
        return self._shuffled

    # ---- loading ------------------------------------------------------------------------------------------------

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy this rank's slice of each owned FULL HF tensor into its region of the engine parameter; return the
        loaded names in order.

        Names not owned are skipped. Every shape and dtype is checked against the full HF meta before any byte is
        written: on a mismatch this raises ValueError naming each offending tensor, and storage is untouched.
        """
        owned = [(name, tensor) for name, tensor in named if name in self._full]
        problems = []
        for name, tensor in owned:
            meta = self._full[name]
            if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
                problems.append(
                    f"{name}: expected shape {meta.shape} dtype {_dtype_str(meta.dtype)}, "
                    f"got shape {tuple(tensor.shape)} dtype {_dtype_str(tensor.dtype)}"
                )
        if problems:
            raise ValueError(f"{self.role} runner rejected the payload: " + "; ".join(problems))
        with self.weights_lock:
            for name, tensor in owned:
                shard = shard_tensor(name, tensor, shape=self.shape, tp_rank=self.tp_rank, tp_size=self.tp_size)
                region = self._region(self._part_of[name])
                assert shard.shape == region.shape, f"{name}: shard {tuple(shard.shape)} vs {tuple(region.shape)}"
                region.copy_(shard)
            self._loaded.update(name for name, _ in owned)
            self._epoch += 1
        return [name for name, _ in owned]

    def loaded_in_session(self) -> frozenset[str]:
        """HF names loaded since the last `reset_session`."""
        return frozenset(self._loaded)

    def reset_session(self) -> None:
        with self.weights_lock:
            self._loaded.clear()

    def partially_loaded(self) -> list[str]:
        """Sorted engine names of which some, but not all, fused HF parts were loaded this session: finalizing one
        transforms the stale rows with the fresh ones, as SGLang's post-processing would."""
        return sorted(
            name
            for name, parts in self._parts.items()
            if 0 < sum(part.hf_name in self._loaded for part in parts) < len(parts)
        )

    # ---- post-load processing ---------------------------------------------------------------------------------

    def finalize(self, names: Iterable[str]) -> None:
        """Post-load hook: apply the layout once to each engine parameter holding any of the HF `names`, then
        rebuild the compute view of every shuffled parameter.

        Not idempotent with the AITER layout (see `runner.Runner.finalize`). Unknown names raise ValueError before
        anything changes.
        """
        names = list(dict.fromkeys(names))
        unknown = [name for name in names if name not in self._part_of]
        if unknown:
            raise ValueError(f"{self.role} runner cannot finalize tensors it does not own: {', '.join(unknown)}")
        engine_names = dict.fromkeys(self._part_of[name].engine_name for name in names)
        with self.weights_lock:
            for name in engine_names:
                if name in self._shuffled:
                    stored = self._stored[name]
                    stored.copy_(self._layout_spec.apply(stored))
            # The kernel's view of the physical bytes: decoded from every shuffled weight, stale or not.
            for name in self._shuffled:
                logical = self._layout_spec.undo(self._stored[name])
                for part in self._parts[name]:
                    part.param.data.copy_(logical if part.is_whole else logical[part.start : part.end])
            self._epoch += 1

    def finalize_all(self) -> None:
        """Finalize every linear engine weight, as SGLang does per runner (and at start-up)."""
        self.finalize(part.hf_name for name in sorted(self._linear) for part in self._parts[name])

    def overwrite(self, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Copy `named` ((engine name, local tensor) pairs or a mapping) into storage as PHYSICAL bytes (no layout
        applied), then refresh the compute view; not recorded as loaded. ValueError before anything is written for
        an unknown name or a shape/dtype that is not the stored one."""
        named = list(named.items() if isinstance(named, Mapping) else named)
        problems = []
        for name, tensor in named:
            stored = self._stored.get(name)
            if stored is None:
                problems.append(f"{name}: not an engine parameter of this runner")
            elif tuple(tensor.shape) != tuple(stored.shape) or tensor.dtype != stored.dtype:
                problems.append(f"{name}: expected shape {tuple(stored.shape)} dtype {_dtype_str(stored.dtype)}")
        if problems:
            raise ValueError(f"{self.role} runner cannot overwrite: " + "; ".join(problems))
        with self.weights_lock:
            for name, tensor in named:
                self._stored[name].copy_(tensor)
            self.finalize([])

    # ---- reading the weights ------------------------------------------------------------------------------------

    def stored_tensors(self) -> Mapping[str, torch.Tensor]:
        """Read-only {engine name: this rank's physical tensor} (hold `weights_lock` for a consistent read)."""
        return types.MappingProxyType(self._stored)

    def _region(self, part: _Part) -> torch.Tensor:
        stored = self._stored[part.engine_name]
        return stored if part.is_whole else stored[part.start : part.end]

    def __repr__(self) -> str:
        kind = "mtp" if self.is_mtp else type(self.model).__name__
        return (
            f"ShardedRunner(role={self.role.value}, model={kind}, layout={self.layout.value}, "
            f"tp={self.tp_rank}/{self.tp_size}, tensors={len(self._stored)})"
        )


def _parts(engine_name: str, named: list[tuple[str, nn.Parameter]]) -> list[_Part]:
    """The parts of one engine parameter, concatenated along dim 0 in the given order."""
    parts, row = [], 0
    for name, param in named:
        rows = param.shape[0] if param.dim() else 0
        is_whole = len(named) == 1
        parts.append(
            _Part(hf_name=name, engine_name=engine_name, start=row, end=row + rows, param=param, is_whole=is_whole)
        )
        row += rows
    return parts


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- loading a checkpoint ---------------------------------------------------------------------------------------


def _populate(runner: ShardedRunner, tensors: Mapping[str, torch.Tensor], *, source: str) -> ShardedRunner:
    """Fill a fresh runner from full checkpoint tensors, then finalize it once (start-up post-processing)."""
    missing = sorted(runner.owned_names() - tensors.keys())
    if missing:
        raise ValueError(
            f"checkpoint {source!r} lacks {len(missing)} tensor(s) of the {runner.role} runner: "
            f"{shorten(missing, limit=_NUM_SHOWN)}"
        )
    runner.load(tensors.items())
    runner.reset_session()
    runner.finalize_all()
    return runner


def load_sharded_runners(
    model_path: str | os.PathLike,
    *,
    draft_kind: str = "none",
    draft_path: str | os.PathLike | None = None,
    layout: WeightLayout = WeightLayout.NONE,
    tp_rank: int,
    tp_size: int,
    group: Any = None,
) -> tuple[ShardedRunner, ShardedRunner | None]:
    """This rank's target runner and, for draft_kind mtp (from the target checkpoint) or standalone (from
    `draft_path`), its draft runner, as `runner.load_runners`; all share one weights lock.

    Raises ValueError before building anything for an unknown kind, a missing/unneeded draft path, or a model that
    does not split at `tp_size` (naming the model and each dimension).
    """
    kind = str(getattr(draft_kind, "value", draft_kind))
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft_kind {kind!r} is not one of {', '.join(DRAFT_KINDS)}")
    if (kind == "standalone") != (draft_path is not None):
        raise ValueError(
            f"draft_path={None if draft_path is None else str(draft_path)!r} with draft_kind {kind!r}: a draft "
            f"path is required for 'standalone' and not accepted otherwise"
        )
    config = read_config(model_path)
    # The MTP head has the target's attention and MLP dimensions: the target's problems cover it.
    models = [(f"target model {str(model_path)!r}", config)]
    if kind == "standalone":
        models.append((f"standalone draft model {str(draft_path)!r}", read_config(draft_path)))
    problems = [f"{what}: {p}" for what, cfg in models for p in tp_problems(TPShape.from_config(cfg), tp_size)]
    if problems:
        raise ValueError(f"cannot shard at tp_size={tp_size}: " + "; ".join(problems))
    tensors = read_safetensors(model_path)
    if kind == "mtp" and num_mtp_layers(config) < 1 and not any(n.startswith(mtp_prefix(config)) for n in tensors):
        raise ValueError(
            f"checkpoint {str(model_path)!r} has no MTP layer: config num_nextn_predict_layers is 0 and no tensor "
            f"is named {mtp_prefix(config)}*"
        )
    tp = {"tp_rank": tp_rank, "tp_size": tp_size, "group": group}
    lock = threading.RLock()
    target = ShardedRunner(role=Role.TARGET, model=ShardedCausalLM(config, **tp), layout=layout, weights_lock=lock)
    _populate(target, tensors, source=str(model_path))
    if kind == "mtp":
        draft = ShardedRunner(role=Role.DRAFT, model=ShardedMTPHead(config, **tp), layout=layout, weights_lock=lock)
        return target, _populate(draft, tensors, source=str(model_path))
    if kind == "standalone":
        draft_config = models[1][1]
        model = ShardedCausalLM(draft_config, **tp)
        draft = ShardedRunner(role=Role.DRAFT, model=model, layout=layout, weights_lock=lock)
        return target, _populate(draft, read_safetensors(draft_path), source=str(draft_path))
    return target, None
