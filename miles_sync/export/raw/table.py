"""`RuleConverter`: a `Converter` (export/converter.py) built from a family's rule table.

Decoder layer i maps to `model.layers.{i}.`; MTP layer k of a model with L decoder layers maps to
`model.layers.{L + k}.` (DeepSeek-V3 numbering), its transformer layer under the family's usual layer names.
Atomic units (`TensorMapping.unit_key`) come from the HF names through the shared table of export/units.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from miles_sync.export import shard_merge
from miles_sync.export.converter import ShardMerge, SliceReader, TensorMapping
from miles_sync.export.raw.mtp import MTP_RULES, hf_layer_index
from miles_sync.export.raw.rules import DENSE_LAYER_RULES, Rule
from miles_sync.export.units import unit_slot

_DECODER_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
_MTP_TRANSFORMER_LAYER = "transformer_layer."


class RuleConverter:
    """A `Converter` (see export/converter.py) defined by `layer_rules`; subclasses set `arch` and the rules.

    Construction reads only architecture sizes from the HF config; the instance is immutable and cheap.
    """

    arch: str = ""
    layer_rules: tuple[Rule, ...] = DENSE_LAYER_RULES

    def __init__(self, hf_config: object) -> None:
        num_heads = int(hf_config.num_attention_heads)
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None)
        num_kv_heads = num_heads if num_kv_heads is None else int(num_kv_heads)
        head_dim = getattr(hf_config, "head_dim", None)
        head_dim = int(hf_config.hidden_size) // num_heads if head_dim is None else int(head_dim)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.attention = shard_merge.AttentionDims(
            num_query_groups=num_kv_heads, heads_per_group=num_heads // num_kv_heads, head_dim=head_dim
        )
        self.vocab_size = int(hf_config.vocab_size)
        self.num_layers = int(hf_config.num_hidden_layers)
        self.is_tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._layer_rules = [(re.compile(r.pattern), r) for r in self.layer_rules]
        self._mtp_rules = [(re.compile(r.pattern), r) for r in MTP_RULES]

    def map_param(self, name: str, full_shape: tuple[int, ...]) -> TensorMapping:
        if name == "embedding.word_embeddings.weight":
            return self._mapping(name, full_shape, ("model.embed_tokens.weight",), ShardMerge.VOCAB)
        if name == "output_layer.weight":
            # A tied model's last pipeline stage keeps its own copy of the embedding: import it, never export it.
            hf_name = "model.embed_tokens.weight" if self.is_tied else "lm_head.weight"
            return self._mapping(name, full_shape, (hf_name,), ShardMerge.VOCAB, is_exported=not self.is_tied)
        if name == "decoder.final_layernorm.weight":
            return self._mapping(name, full_shape, ("model.norm.weight",), ShardMerge.COPY)
        match = _DECODER_LAYER.fullmatch(name)
        if match is not None:
            return self._match_rules(name, full_shape, f"model.layers.{int(match[1])}.", match[2], self._layer_rules)
        match = _MTP_LAYER.fullmatch(name)
        if match is not None:
            prefix = f"model.layers.{hf_layer_index(num_layers=self.num_layers, mtp_layer=int(match[1]))}."
            rest = match[2]
            if rest.startswith(_MTP_TRANSFORMER_LAYER):
                return self._match_rules(
                    name, full_shape, prefix, rest[len(_MTP_TRANSFORMER_LAYER) :], self._layer_rules
                )
            return self._match_rules(name, full_shape, prefix, rest, self._mtp_rules)
        raise ValueError(f"{self.arch} converter has no mapping for megatron parameter {name!r}")

    def to_hf(
        self, mapping: TensorMapping, shards: Sequence[torch.Tensor], *, partition_dim: int | None
    ) -> tuple[torch.Tensor, ...]:
        return shard_merge.merge_shards(
            mapping.merge, shards, partition_dim=partition_dim, attention=self.attention, vocab_size=self.vocab_size
        )

    def read_shard(
        self,
        mapping: TensorMapping,
        read: SliceReader,
        *,
        partition_dim: int | None,
        rank: int,
        size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        def read_as(hf_name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
            return read(hf_name, dim, start, stop).to(dtype)

        shard = shard_merge.read_shard(
            mapping.merge,
            mapping,
            read_as,
            partition_dim=partition_dim,
            rank=rank,
            size=size,
            attention=self.attention,
        )
        return shard.contiguous()

    def _match_rules(
        self,
        name: str,
        full_shape: tuple[int, ...],
        prefix: str,
        rest: str,
        rules: list[tuple[re.Pattern[str], Rule]],
    ) -> TensorMapping:
        for pattern, rule in rules:
            match = pattern.fullmatch(rest)
            if match is None:
                continue
            fields = match.groupdict()
            hf_names = tuple(prefix + n.format(**fields) for n in rule.hf_names)
            return self._mapping(name, full_shape, hf_names, rule.merge)
        raise ValueError(f"{self.arch} converter has no mapping for megatron parameter {name!r}")

    def _mapping(
        self,
        name: str,
        full_shape: tuple[int, ...],
        hf_names: tuple[str, ...],
        merge: ShardMerge,
        *,
        is_exported: bool = True,
    ) -> TensorMapping:
        # One parameter's HF tensors always travel together, in the unit order the shared table gives them.
        slots = [unit_slot(n) for n in hf_names]
        if len({key for key, _ in slots}) != 1 or [p for _, p in slots] != sorted({p for _, p in slots}):
            raise ValueError(
                f"{self.arch} converter maps {name!r} to {list(hf_names)}, which the unit table (export/units.py) "
                f"places at {slots}: one parameter's tensors must fill one unit in ascending positions"
            )
        shapes = shard_merge.hf_shapes(merge, full_shape, attention=self.attention, vocab_size=self.vocab_size)
        return TensorMapping(
            megatron_name=name,
            megatron_shape=tuple(full_shape),
            unit_key=slots[0][0],
            merge=merge,
            hf_names=hf_names,
            hf_shapes=shapes,
            is_exported=is_exported,
        )
