"""Predicting what each engine's weights checker answers, from the HF tensors a sync sends ("engine-exact").

An engine that answers engine-parameter digests (SGLang, the reference engine at TP > 1) hashes, per TP rank and
role, its own fused parameters (`qkv_proj`, `gate_up_proj`), its TP shard, after post-processing
(`miles_sync.weights.engine_layout`). What decides that answer, given the tensors sent, is one `EngineLayout`:
TP size, weight layout, the TP split's dimensions, and which HF names each runner holds. Two halves:

- controller side (`plan_engine_digests`): from what each engine reported at connect (`ServerInfo`: model_path,
  tp_size, weight_layout), its model's config.json (read here, when that path is readable) and its draft report,
  one `EngineLayout` per engine that has a layout model, and the `EngineDigestPlan` (the distinct layouts) that
  travels with the send. An engine without one (no weight_layout reported, config unreadable, a family or a
  quantization this model does not cover) falls back to the replica check, with the reason kept.
- source side (`EngineDigester`): fed each bucket's tensors on the sender's hasher thread, it computes every
  layout's expected per-rank digests while the bucket is on the wire. Fused groups (q/k/v, gate/up of one layer,
  the stacked experts of one MoE block) may straddle buckets: the rank slices of an incomplete group are copied
  and kept until the group completes (the bucket buffer is reused), so memory stays bounded by what is pending.
  Without a layout to apply, a group's parts are hashed as they come, in order (SGLang hashes the bytes of
  cat(parts) along dim 0, i.e. the parts' bytes one after another; a stack of experts has the same bytes); only
  parts that arrive ahead of their predecessors are kept.

Expected digests are named as SGLang merges runners with the draft role "draft": target names unprefixed, draft
names "draft.<name>". The verifier maps an answer's own draft role ("draft_step_0", ...) onto them.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_sync.weights.checksum import (
    TensorHash,
    sglang_digest,
    sglang_fused_tensor,
    sglang_parameter_names,
    sglang_reported_name,
)
from miles_sync.weights.engine_layout import (
    ShardKind,
    TPShape,
    is_linear_weight,
    shard_kind,
    shard_tensor,
    tp_problems,
)
from miles_sync.weights.layout import LayoutSpec, WeightLayout, layout_spec
from miles_sync.weights.shard_plan import DirectLayout, is_target_layer
from miles_sync.wire.api import EngineAPI, ServerInfo
from miles_sync.wire.draft import DraftReport
from miles_sync.wire.protocol import ChecksumNames, Role, Selector, selector_roles
from miles_sync.wire.text import raise_if

__all__ = ["EngineDigestPlan"]

logger = logging.getLogger(__name__)

# config.json model types whose TP split `miles_sync.weights.engine_layout` describes (decoders with separate q/k/v
# and gate/up projections; Qwen3-MoE's experts stacked and TP-split as FusedMoE's); other families have no model.
MODELED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
_DRAFT_ROLE = Role.DRAFT.value
_TARGET_ROLE = Role.TARGET.value


@dataclass(frozen=True, kw_only=True)
class EngineLayout:
    """Everything that decides an engine's checksum answer for given HF tensors; engines with equal layouts
    answer equal digests. Hashable: it keys `SendResult.engine_checksums`.

    `num_target_layers`: decoder layers the target runner holds (`model.layers.{i}` with i at or past it belong
    to an MTP head, which the target's loader skips); None: the target holds every name sent. `draft_names`: the
    HF names the draft runner holds (its draft report), sorted; empty when the session does not select the draft.
    """

    tp_size: int
    weight_layout: WeightLayout
    shape: TPShape
    num_target_layers: int | None
    draft_names: tuple[str, ...] = ()
    tensor_hash: TensorHash = TensorHash.SHA256  # the digest its checker computes (SHA-256 on CPU, Triton on GPU)

    def runner_names(self, names: Iterable[str], *, roles: Collection[Role]) -> list[tuple[str, list[str]]]:
        """(role name, the names among `names` its runner holds) for the roles of `roles` this layout has."""
        names = list(names)
        result = []
        if Role.TARGET in roles:
            result.append((_TARGET_ROLE, [n for n in names if self.is_target_name(n)]))
        if Role.DRAFT in roles and self.draft_names:
            owned = frozenset(self.draft_names)
            result.append((_DRAFT_ROLE, [n for n in names if n in owned]))
        return result

    def is_target_name(self, name: str) -> bool:
        return is_target_layer(name, num_target_layers=self.num_target_layers)

    @property
    def direct_layout(self) -> DirectLayout:
        """What decides the engine's target parameters, for a transport that sends them (shard_direct)."""
        return DirectLayout(
            shape=self.shape,
            tp_size=self.tp_size,
            weight_layout=self.weight_layout,
            num_target_layers=self.num_target_layers,
        )


@dataclass(frozen=True, kw_only=True)
class EngineDigestPlan:
    """The distinct engine layouts of a fleet: what the source computes expected digests for during a send."""

    layouts: tuple[EngineLayout, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.layouts)


@dataclass(frozen=True, kw_only=True)
class PredictedDigests:
    """Engine digests a staged export predicted ahead of the pause, for the selector and plan it was given."""

    selector: Selector
    plan: EngineDigestPlan
    checksums: dict[EngineLayout, tuple[dict[str, str], ...]]

    def matches(self, *, selector: Selector, plan: EngineDigestPlan | None) -> bool:
        """Whether a send with `selector` and `plan` may return these instead of hashing again."""
        return bool(plan) and selector == self.selector and plan == self.plan


@dataclass(frozen=True, kw_only=True)
class FleetLayouts:
    """The controller's side of a plan: `by_url` each engine with a layout model, `fallbacks` why each other
    engine answering engine-parameter digests has none (it falls back to the replica check)."""

    plan: EngineDigestPlan = EngineDigestPlan()
    by_url: Mapping[str, EngineLayout] = field(default_factory=dict)
    fallbacks: Mapping[str, str] = field(default_factory=dict)


# ---- controller side ------------------------------------------------------------------------------------------


def read_model_config(model_path: str | None) -> dict[str, Any] | None:
    """`<model_path>/config.json` as a mapping, None when there is no such readable file here (a hub id, a path
    on another machine)."""
    if not model_path:
        return None
    try:
        with open(Path(model_path) / "config.json") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def engine_layout(
    *, info: ServerInfo, config: Mapping[str, Any] | None, draft: DraftReport | None, selector: Selector
) -> EngineLayout:
    """The layout model of one engine; ValueError naming why there is none (the replica check then applies)."""
    weight_layout = served_weight_layout(info)
    tensor_hash = served_tensor_hash(info)
    if config is None:
        raise ValueError(f"no readable config.json under model_path {info.model_path!r}")
    model_type = config.get("model_type")
    if model_type not in MODELED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of the modeled families {MODELED_MODEL_TYPES}")
    if config.get("quantization_config") is not None:
        raise ValueError("quantized checkpoints are not modeled")
    shape = TPShape.from_config(config)
    if shape.num_experts and info.weight_layout is None and tensor_hash is TensorHash.GPU_HASH:
        # ROCm servers (a "cuda" device to torch) shuffle FusedMoE weights for AITER after loading; what a GPU
        # server reports does not tell them from NVIDIA ones, so its experts' bytes are not predicted.
        raise ValueError("a GPU server may post-process its MoE experts (AITER on ROCm): not modeled")
    problems = tp_problems(shape, info.tp_size, split_experts=True)  # FusedMoE's TP split is modeled
    if problems:
        raise ValueError("; ".join(problems))
    has_draft = Role.DRAFT in selector_roles(selector) and draft is not None and draft.has_runner
    num_layers = config.get("num_hidden_layers")
    return EngineLayout(
        tp_size=info.tp_size,
        weight_layout=weight_layout,
        shape=shape,
        num_target_layers=None if num_layers is None else int(num_layers),
        draft_names=tuple(sorted(draft.owned_names)) if has_draft else (),
        tensor_hash=tensor_hash,
    )


def served_weight_layout(info: ServerInfo) -> WeightLayout:
    """The post-load layout of an engine's parameters as its checker hashes them; ValueError naming why it is
    unknown (the replica check then applies).

    The reference engine reports its `weight_layout`. A real SGLang server reports none, so it is inferred from
    its device. A CPU server (`device: "cpu"`) and a CUDA one (`"cuda"`) keep unquantized dense parameters as
    loaded: SGLang 0.5.23's `UnquantizedLinearMethod.process_weights_after_loading` only repacks for AMX on CPU
    (checked against SGLang 0.5.23 on CPU in tests/sglang/). On CPUs with AMX the answer differs from the
    prediction and the sync fails verification, naming the parameters, rather than passing unchecked; a GPU
    server's MoE experts are not modeled (`engine_layout`).
    """
    if info.weight_layout is not None:
        try:
            return WeightLayout(info.weight_layout)
        except ValueError:
            raise ValueError(f"weight_layout {info.weight_layout!r} is not modeled") from None
    if info.device in ("cpu", "cuda"):
        return WeightLayout.NONE
    if info.device is None:
        raise ValueError("the server reports neither its weight_layout nor its device (post-processing unknown)")
    raise ValueError(f"a {info.device!r} server's post-processing is not modeled")


def served_tensor_hash(info: ServerInfo) -> TensorHash:
    """The digest an engine's checker computes: what the reference engine reports (`miles_sync_tensor_hash`), else
    by device, as SGLang's `tensor_hash` chooses: SHA-256 for CPU tensors, its Triton kernel for CUDA ones
    (`miles_sync.weights.gpu_hash`). ValueError when neither is known (the replica check then applies)."""
    if info.miles_sync_tensor_hash is not None:
        try:
            return TensorHash(info.miles_sync_tensor_hash)
        except ValueError:
            raise ValueError(f"tensor hash {info.miles_sync_tensor_hash!r} is not modeled") from None
    if info.device == "cpu" or (info.device is None and info.weight_layout is not None):
        return TensorHash.SHA256  # a reference engine reporting its layout but not its hash hashes with SHA-256
    if info.device == "cuda":
        return TensorHash.GPU_HASH
    raise ValueError(f"the server's device {info.device!r} does not say how its checker hashes")


async def read_direct_layouts(engines: Sequence[EngineAPI]) -> dict[str, DirectLayout]:
    """Every engine's target parameter layout (from what it reported at connect and its config.json), for a
    transport that sends the engines' own parameters. Raises ValueError naming each engine whose layout is not
    modeled, and why."""
    by_url, fallbacks = await _model_layouts(engines, drafts=[None] * len(engines), selector=Selector.TARGET)
    raise_if([f"{url}: {why}" for url, why in fallbacks.items()], what="the engines' own parameter layouts are unknown")
    return {url: layout.direct_layout for url, layout in by_url.items()}


async def plan_engine_digests(engines: Sequence[EngineAPI], *, selector: Selector, timeout_s: float) -> FleetLayouts:
    """The layout of every engine answering engine-parameter digests, from what it reported at connect, its
    config.json and (when the selector covers the draft) its draft report. Never raises: an engine whose layout
    cannot be modeled gets a fallback reason instead."""
    candidates = [e for e in engines if e.info is None or e.info.miles_sync_checksum_names is ChecksumNames.ENGINE]
    needs_draft = Role.DRAFT in selector_roles(selector)

    async def draft_of(engine: EngineAPI) -> DraftReport | None | BaseException:
        if not needs_draft:
            return None
        try:
            return await engine.draft_report(timeout_s=timeout_s)
        except Exception as exc:
            return exc

    drafts = await asyncio.gather(*(draft_of(e) for e in candidates))
    by_url, fallbacks = await _model_layouts(candidates, drafts=drafts, selector=selector)
    plan = EngineDigestPlan(layouts=tuple(dict.fromkeys(by_url.values())))
    return FleetLayouts(plan=plan, by_url=by_url, fallbacks=fallbacks)


async def _model_layouts(
    engines: Sequence[EngineAPI], *, drafts: Sequence[DraftReport | None | BaseException], selector: Selector
) -> tuple[dict[str, EngineLayout], dict[str, str]]:
    """({url: layout} of the engines whose layout is modeled, {url: why not} of the others), in engine order, from
    each one's server info, its config.json (read once per model path) and its draft report."""
    paths = sorted({e.info.model_path for e in engines if e.info is not None and e.info.model_path})
    configs = dict(zip(paths, await asyncio.gather(*(asyncio.to_thread(read_model_config, p) for p in paths))))
    by_url: dict[str, EngineLayout] = {}
    fallbacks: dict[str, str] = {}
    for engine, draft in zip(engines, drafts):
        if engine.info is None:
            fallbacks[engine.url] = "its server info was never read"
            continue
        if isinstance(draft, BaseException):
            fallbacks[engine.url] = f"its draft report could not be read: {draft}"
            continue
        try:
            config = configs.get(engine.info.model_path) if engine.info.model_path else None
            by_url[engine.url] = engine_layout(info=engine.info, config=config, draft=draft, selector=selector)
        except ValueError as exc:
            fallbacks[engine.url] = str(exc)
    return by_url, fallbacks


# ---- source side ----------------------------------------------------------------------------------------------


class EngineDigester:
    """Expected per-rank engine digests of every layout of `plan`, streamed from the tensors of one send.

    `names`: the HF names the send covers (the export's names; they decide which parts fuse). `add` takes one
    bucket's (name, tensor) pairs; the tensors may be views into a buffer that is reused after the call. Call from
    one thread at a time. `finish` returns {layout: per TP rank {expected name: digest}}; a group still incomplete
    then (a part never sent) is left out, and so is a layout whose computation failed (its engines fall back)."""

    def __init__(self, plan: EngineDigestPlan, *, names: Iterable[str], selector: Selector) -> None:
        names = tuple(names)
        roles = selector_roles(selector)
        self._layouts = [_LayoutDigests(layout, names=names, roles=roles) for layout in plan.layouts]

    @property
    def pending_bytes(self) -> int:
        """Bytes of rank slices kept for incomplete groups (what is pending between buckets)."""
        return sum(d.pending_bytes for d in self._layouts)

    def add(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = list(named)
        for digests in self._layouts:
            if digests.error is not None:
                continue
            try:
                digests.add(named)
            except Exception as exc:  # a prediction problem must not fail the send: those engines fall back
                digests.fail(f"{type(exc).__name__}: {exc}")

    def finish(self) -> dict[EngineLayout, tuple[dict[str, str], ...]]:
        return {d.layout: d.finish() for d in self._layouts if d.error is None}


@dataclass(kw_only=True)
class _Group:
    """One engine parameter of one role: its HF parts (in fusion order) and the state of an incomplete one."""

    reported: str  # its name in the answer
    engine_name: str
    parts: tuple[str, ...]
    streams: bool  # parts are hashed as they come (no layout can apply to it)
    next_part: int = 0  # streaming: the first part not hashed yet
    pending: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # part index -> rank slices (copies)
    hashers: list[Any] = field(default_factory=list)  # streaming: one SHA-256 per rank

    @property
    def pending_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for slices in self.pending.values() for s in slices)


class _LayoutDigests:
    def __init__(self, layout: EngineLayout, *, names: Sequence[str], roles: Collection[Role]) -> None:
        self.layout = layout
        self.error: str | None = None
        self._roles = roles
        self._spec: LayoutSpec = layout_spec(layout.weight_layout)
        self._digests: list[dict[str, str]] = [{} for _ in range(layout.tp_size)]
        self._members: dict[str, list[tuple[_Group, int]]] = collections.defaultdict(list)
        for role_name, role_names in layout.runner_names(names, roles=roles):
            fused = sglang_parameter_names(role_names, num_experts=layout.shape.num_experts or None)
            for engine_name, parts in fused.items():
                self._register(role_name, engine_name, parts)

    def _register(self, role_name: str, engine_name: str, parts: tuple[str, ...]) -> None:
        # SHA-256 streams over the parts' bytes in order; the GPU hash mixes each word with its position in the
        # whole tensor, so its groups wait for every part.
        is_unshuffled = self.layout.weight_layout is WeightLayout.NONE or not is_linear_weight(engine_name)
        streams = is_unshuffled and self.layout.tensor_hash is TensorHash.SHA256
        group = _Group(
            reported=sglang_reported_name(role_name, engine_name), engine_name=engine_name, parts=parts, streams=streams
        )
        if streams and len(parts) > 1:
            group.hashers = [hashlib.sha256() for _ in range(self.layout.tp_size)]
        for index, part in enumerate(parts):
            self._members[part].append((group, index))

    @property
    def pending_bytes(self) -> int:
        groups = {id(g): g for members in self._members.values() for g, _ in members}
        return sum(g.pending_bytes for g in groups.values())

    def fail(self, message: str) -> None:
        logger.warning(
            "engine digests for %s dropped (its engines fall back to the replica check): %s", self.layout, message
        )
        self.error = message
        self._members.clear()

    def add(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            if name not in self._members:  # a name the export's name list did not announce: a group of its own
                for role_name, owned in self.layout.runner_names([name], roles=self._roles):
                    if owned:
                        self._register(role_name, name, (name,))
            for group, index in self._members.pop(name, ()):
                self._feed(group, index, name, tensor)

    def _feed(self, group: _Group, index: int, name: str, tensor: torch.Tensor) -> None:
        tp_size, shape = self.layout.tp_size, self.layout.shape
        if len(group.parts) == 1:
            if shard_kind(name) is ShardKind.REPLICATED:  # every rank holds the same bytes: hash them once
                digest = self._hash(group.engine_name, tensor)
                for digests in self._digests:
                    digests[group.reported] = digest
                return
            for rank, digests in enumerate(self._digests):
                shard = shard_tensor(name, tensor, shape=shape, tp_rank=rank, tp_size=tp_size)
                digests[group.reported] = self._hash(group.engine_name, shard)
            return
        slices = [shard_tensor(name, tensor, shape=shape, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
        if group.streams and index == group.next_part:
            self._stream(group, slices)  # hashed now: nothing of this bucket is kept
        else:
            group.pending[index] = [_host_copy(s) for s in slices]
        if group.streams:
            while group.next_part in group.pending:
                self._stream(group, group.pending.pop(group.next_part))
            if group.next_part == len(group.parts):
                for digests, hasher in zip(self._digests, group.hashers):
                    digests[group.reported] = hasher.hexdigest()[:16]
                group.hashers = []
        elif len(group.pending) == len(group.parts):
            for rank, digests in enumerate(self._digests):
                fused = sglang_fused_tensor(
                    group.engine_name, [group.pending[i][rank] for i in range(len(group.parts))]
                )
                digests[group.reported] = self._hash(group.engine_name, fused)
            group.pending.clear()

    @staticmethod
    def _stream(group: _Group, slices: Sequence[torch.Tensor]) -> None:
        for hasher, part in zip(group.hashers, slices):
            hasher.update(_host_bytes(part))
        group.next_part += 1

    def _hash(self, engine_name: str, tensor: torch.Tensor) -> str:
        # As `engine_layout.rank_engine_tensors`: the layout applies to linear weights whose shape it covers.
        tensor = tensor.contiguous()
        if is_linear_weight(engine_name) and self._spec.applies_to(tuple(tensor.shape), tensor.dtype):
            tensor = self._spec.apply(tensor)
        return sglang_digest(tensor, self.layout.tensor_hash)

    def finish(self) -> tuple[dict[str, str], ...]:
        return tuple(dict(d) for d in self._digests)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy (never a view: the bucket buffer it comes from is reused)."""
    return t.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)


def _host_bytes(t: torch.Tensor) -> Any:
    # reshape(-1) first: 0-dim tensors cannot be viewed as bytes directly.
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
