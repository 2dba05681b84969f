"""Engine-exact verification: the source predicts each TP rank's engine-parameter digests from the HF tensors it
sends, and the session compares them with each engine's answer per rank, role and parameter.

The expected digests are recomputed here independently with SGLang's formulas (its parallel layers' TP split for a
tiny Qwen3, fused q/k/v and gate/up, the AITER shuffle, `tensor_hash` = the first 16 hex digits of SHA-256 over the
raw bytes, `overall_checksum` = SHA-256 over the sorted name + digest pairs). The sessions run a real Sender through
an in-process transport (the network is the only part replaced) against in-memory engines answering as a TP>1
SGLang engine does."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json

import pytest
import torch

from miles_sync.export.registry import ConversionMode
from miles_sync.export.units import ExportedUnit
from miles_sync.sync.engine_digests import (
    EngineDigester,
    EngineDigestPlan,
    EngineLayout,
    engine_layout,
    plan_engine_digests,
)
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.sender import Sender, SenderSettings
from miles_sync.sync.session import SelectorInputs, SessionTimeouts, run_sync_session
from miles_sync.sync.verify import REPLICA, UNVERIFIED, engine_exact, fleet_verdicts
from miles_sync.transport.base import TRANSPORTS, TransportSpec, source_rank
from miles_sync.transport.membership import EngineEndpoint
from miles_sync.weights.checksum import TensorHash, sglang_overall_checksum
from miles_sync.weights.engine_layout import TPShape, rank_engine_digests
from miles_sync.weights.layout import WeightLayout, can_shuffle, shuffle_weight
from miles_sync.wire.api import ServerInfo
from miles_sync.wire.bucket import AtomicUnit, TensorMeta
from miles_sync.wire.codec import decode
from miles_sync.wire.draft import DraftKind, DraftReport
from miles_sync.wire.protocol import (
    ChecksumNames,
    ParallelismInfo,
    PauseMode,
    RankChecksums,
    Selector,
    WeightsCheckerResult,
    selector_roles,
)

pytestmark = pytest.mark.unit

# A tiny Qwen3 with one decoder layer and a DeepSeek-style MTP head at layer index 1 (num_hidden_layers).
SHA256_EXACT = engine_exact("sha256")  # what a CPU (SHA-256) engine-exact verdict is named

CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 100,  # padded to 128 by the vocab-parallel layers
    "num_hidden_layers": 1,
    "tie_word_embeddings": False,
}
SHAPE = TPShape.from_config(CONFIG)
MOE_CONFIG = {**CONFIG, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32}


def decoder_layer(prefix: str) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.input_layernorm.weight": (64,),
        # k before q: a fused group whose parts arrive out of order
        f"{prefix}.self_attn.k_proj.weight": (32, 64),
        f"{prefix}.self_attn.q_proj.weight": (64, 64),
        f"{prefix}.self_attn.v_proj.weight": (32, 64),
        f"{prefix}.self_attn.o_proj.weight": (64, 64),
        f"{prefix}.self_attn.q_norm.weight": (16,),
        f"{prefix}.self_attn.k_norm.weight": (16,),
        f"{prefix}.post_attention_layernorm.weight": (64,),
        f"{prefix}.mlp.gate_proj.weight": (128, 64),
        f"{prefix}.mlp.up_proj.weight": (128, 64),
        f"{prefix}.mlp.down_proj.weight": (64, 128),
    }


TARGET_SHAPES = {
    "model.embed_tokens.weight": (100, 64),
    **decoder_layer("model.layers.0"),
    "model.norm.weight": (64,),
    "lm_head.weight": (100, 64),
}
MTP_SHAPES = {
    "model.layers.1.enorm.weight": (64,),
    "model.layers.1.hnorm.weight": (64,),
    "model.layers.1.eh_proj.weight": (64, 128),
    **decoder_layer("model.layers.1"),
    "model.layers.1.shared_head.norm.weight": (64,),
}
DRAFT_NAMES = tuple(sorted(MTP_SHAPES))
QKV = "model.layers.0.self_attn.qkv_proj.weight"


def hf_tensors(shapes: dict[str, tuple[int, ...]], *, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in shapes.items()}


def layout(tp_size: int, weight_layout: WeightLayout, *, draft: bool = True) -> EngineLayout:
    return EngineLayout(
        tp_size=tp_size,
        weight_layout=weight_layout,
        shape=SHAPE,
        num_target_layers=1,
        draft_names=DRAFT_NAMES if draft else (),
    )


# ---- SGLang's formulas, written out for this config ------------------------------------------------------------


def sglang_rank_tensor(name: str, t: torch.Tensor, *, tp: int, rank: int) -> torch.Tensor:
    """The slice of HF tensor `name` that SGLang's parallel layers keep on `rank` of `tp`, for CONFIG."""
    module = name.rsplit(".", 2)[-2]
    if module in ("q_proj", "gate_proj", "up_proj"):  # column-parallel
        size = t.shape[0] // tp
        return t[rank * size : (rank + 1) * size]
    if module in ("k_proj", "v_proj"):  # 2 KV heads of 16: split, or replicated once there are more ranks
        heads_per_rank, replicas = max(1, 2 // tp), max(1, tp // 2)
        block = rank // replicas
        return t[block * heads_per_rank * 16 : (block + 1) * heads_per_rank * 16]
    if module in ("o_proj", "down_proj"):  # row-parallel
        size = t.shape[1] // tp
        return t[:, rank * size : (rank + 1) * size]
    if module in ("embed_tokens", "lm_head"):  # vocab-parallel, padded to 128 rows with zeros
        padded = torch.cat([t, t.new_zeros(128 - t.shape[0], t.shape[1])])
        size = 128 // tp
        return padded[rank * size : (rank + 1) * size]
    return t


def sglang_tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def sglang_overall(checksums: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update((name + checksums[name]).encode())
    return h.hexdigest()


# HF module -> (the SGLang parameter it is fused into, its place there)
FUSED_INTO = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
}
LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "eh_proj", "lm_head")


def expected_rank_digests(
    roles: list[tuple[str, dict[str, torch.Tensor]]], *, tp: int, rank: int, aiter: bool
) -> dict[str, str]:
    checksums = {}
    for role, tensors in roles:
        params: dict[str, torch.Tensor] = {}
        fused: dict[str, dict[int, torch.Tensor]] = {}
        for name, t in tensors.items():
            *path, module, leaf = name.split(".")
            local = sglang_rank_tensor(name, t, tp=tp, rank=rank)
            if module in FUSED_INTO:
                engine_module, place = FUSED_INTO[module]
                fused.setdefault(f"{'.'.join(path[:-1])}.{engine_module}.{leaf}", {})[place] = local
            else:
                params[name] = local
        for engine_name, parts in fused.items():
            params[engine_name] = torch.cat([parts[i] for i in sorted(parts)])
        for engine_name, t in params.items():
            if aiter and engine_name.rsplit(".", 2)[-2] in LINEAR and can_shuffle(t.shape, t.dtype):
                t = shuffle_weight(t.contiguous())
            checksums[engine_name if role == "target" else f"{role}.{engine_name}"] = sglang_tensor_hash(t)
    return checksums


def expected_digests(
    target: dict[str, torch.Tensor], draft: dict[str, torch.Tensor] | None, of: EngineLayout
) -> tuple[dict[str, str], ...]:
    roles = [("target", target)] + ([] if draft is None else [("draft", draft)])
    return tuple(
        expected_rank_digests(roles, tp=of.tp_size, rank=r, aiter=of.weight_layout is WeightLayout.AITER)
        for r in range(of.tp_size)
    )


# ---- a real Sender over an in-process transport ----------------------------------------------------------------


class MemoryTransport:
    """Registered under a test name: keeps a copy of every bucket's tensors (what an engine would load)."""

    instances: list[MemoryTransport] = []

    def __init__(self, *, engines) -> None:
        self.engines = engines
        self.buckets: list[dict[str, torch.Tensor]] = []
        MemoryTransport.instances.append(self)

    async def open(self, *, membership, timeout_s):
        return membership

    async def send_bucket(self, bucket, *, selector, timeout_s):
        self.buckets.append(
            {e.name: bucket.buffer[e.start : e.end].clone().view(e.dtype).view(e.shape) for e in bucket.entries}
        )

    async def close(self, *, timeout_s):
        return None

    def received(self) -> dict[str, torch.Tensor]:
        return {name: t for bucket in self.buckets for name, t in bucket.items()}


async def open_memory_rank(*, engines, setup):
    return source_rank(MemoryTransport, engines=engines, setup=setup)


@pytest.fixture
def memory(monkeypatch):
    MemoryTransport.instances.clear()
    monkeypatch.setitem(
        TRANSPORTS,
        "memory",
        TransportSpec(module=__name__, rank_factory="open_memory_rank", needs_update_group=False, endpoints=()),
    )
    return MemoryTransport


BUCKET_BYTES = 8192  # a (64, 64) bf16 q_proj fills a bucket: q, k and v of one layer never share one


def make_sender(tensors: dict[str, torch.Tensor]) -> Sender:
    units = [
        ExportedUnit(
            meta=AtomicUnit(key=name, tensors=(TensorMeta(name=name, shape=tuple(t.shape), dtype=t.dtype),)),
            tensors=(t,),
        )
        for name, t in tensors.items()
    ]
    settings = SenderSettings(
        transport="memory",
        bucket_bytes=BUCKET_BYTES,
        bucket_timeout_s=5.0,
        open_timeout_s=5.0,
        http_timeout_s=5.0,
        call_timeout_s=5.0,
    )
    return Sender(settings=settings, export=lambda: iter(units), names=lambda: list(tensors), is_source=True)


def send(sender: Sender, *, selector: Selector, plan: EngineDigestPlan):
    return stage_and_send(sender, selector=selector, plan=plan, stage=None)[1]


def stage_and_send(sender: Sender, *, selector: Selector, plan: EngineDigestPlan, stage: dict | None):
    """(StageResult or None, SendResult) of one send; with `stage` (the keyword arguments of `Sender.stage`), staged
    first."""

    async def main():
        await sender.open(engines=[EngineEndpoint(url="http://127.0.0.1:1", tp_size=2)], membership=None)
        try:
            staged = None if stage is None else await sender.stage(**stage)
            return staged, await sender.send(selector=selector, engine_digests=plan)
        finally:
            await sender.close()

    return asyncio.run(main())


LAYOUTS = (
    layout(2, WeightLayout.AITER),
    layout(2, WeightLayout.NONE),
    layout(4, WeightLayout.AITER),  # 2 KV heads on 4 ranks: each head replicated on 2 ranks
    layout(1, WeightLayout.NONE),
)


PLAN = EngineDigestPlan(layouts=LAYOUTS)
STAGINGS = {
    "live": None,
    "staged": {},  # packed ahead; the digests are hashed during the send
    "staged_with_digests": {"selector": Selector.ALL, "engine_digests": PLAN},  # hashed ahead of the pause too
    # Predicted for another selector (no draft names): the send must hash again, not return those.
    "staged_for_another_selector": {"selector": Selector.TARGET, "engine_digests": PLAN},
}


def test_the_sender_predicts_sglangs_gpu_hash_for_a_gpu_servers_layout(memory):
    """A GPU server's layout: every rank's digests with the Triton hash, fused groups completed across buckets
    (the GPU hash mixes each word with its position, so a group waits for all its parts)."""
    target = hf_tensors(TARGET_SHAPES, seed=1)
    gpu = dataclasses.replace(layout(2, WeightLayout.NONE, draft=False), tensor_hash=TensorHash.GPU_HASH)
    plan = EngineDigestPlan(layouts=(gpu,))
    _, result = stage_and_send(make_sender(target), selector=Selector.TARGET, plan=plan, stage=None)
    expected = rank_engine_digests([("target", target)], shape=SHAPE, tp_size=2, tensor_hash=TensorHash.GPU_HASH)
    assert result.engine_checksums[gpu] == expected
    sha = rank_engine_digests([("target", target)], shape=SHAPE, tp_size=2)
    assert all(expected[r][n] != sha[r][n] for r in range(2) for n in expected[r])


@pytest.mark.parametrize("staging", list(STAGINGS))
def test_the_sender_predicts_every_ranks_digests_with_sglangs_formulas(memory, staging):
    target, draft = hf_tensors(TARGET_SHAPES, seed=1), hf_tensors(MTP_SHAPES, seed=2)
    stage = STAGINGS[staging]
    staged, result = stage_and_send(make_sender({**target, **draft}), selector=Selector.ALL, plan=PLAN, stage=stage)
    if stage:  # every layout was predicted at stage time
        assert staged.engine_layouts == len(LAYOUTS) and staged.digest_s > 0
    elif stage is not None:
        assert staged.engine_layouts == 0 and staged.digest_s == 0
    # q, k and v of a layer straddle buckets (k first): the fused groups were completed across them.
    where = {name: i for i, bucket in enumerate(memory.instances[0].buckets) for name in bucket}
    qkv = [where[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert len(set(qkv)) > 1, qkv
    assert set(result.engine_checksums) == set(LAYOUTS)
    for of in LAYOUTS:
        expected = expected_digests(target, draft, of)
        assert result.engine_checksums[of] == expected, of
        # SGLang's per_gpu_checksum over them, and the engine layout model, agree as well.
        assert [sglang_overall_checksum(d) for d in result.engine_checksums[of]] == [
            sglang_overall(d) for d in expected
        ]
        modeled = rank_engine_digests(
            [("target", target), ("draft", draft)], shape=SHAPE, tp_size=of.tp_size, layout=of.weight_layout
        )
        assert result.engine_checksums[of] == modeled
    # Vocab padding and row-parallel splits show in the digests: the ranks of TP=2 differ.
    tp2 = result.engine_checksums[LAYOUTS[0]]
    assert tp2[0]["lm_head.weight"] != tp2[1]["lm_head.weight"] and tp2[0][QKV] != tp2[1][QKV]
    assert tp2[0]["model.norm.weight"] == tp2[1]["model.norm.weight"]


def test_the_digester_keeps_only_the_rank_slices_of_incomplete_groups():
    tensors = hf_tensors(TARGET_SHAPES, seed=3)
    shuffled, streamed = layout(2, WeightLayout.AITER, draft=False), layout(2, WeightLayout.NONE, draft=False)
    prefix = "model.layers.0.self_attn"

    def digester(of: EngineLayout) -> EngineDigester:
        return EngineDigester(EngineDigestPlan(layouts=(of,)), names=tensors, selector=Selector.TARGET)

    k_bytes = tensors[f"{prefix}.k_proj.weight"].numel() * 2  # both ranks' halves
    q_bytes = tensors[f"{prefix}.q_proj.weight"].numel() * 2
    aiter = digester(shuffled)
    aiter.add([(f"{prefix}.k_proj.weight", tensors[f"{prefix}.k_proj.weight"])])
    assert aiter.pending_bytes == k_bytes  # the fused weight is shuffled whole: its parts wait for each other
    aiter.add([(f"{prefix}.q_proj.weight", tensors[f"{prefix}.q_proj.weight"])])
    assert aiter.pending_bytes == k_bytes + q_bytes
    aiter.add([(f"{prefix}.v_proj.weight", tensors[f"{prefix}.v_proj.weight"])])
    assert aiter.pending_bytes == 0

    plain = digester(streamed)
    plain.add([(f"{prefix}.q_proj.weight", tensors[f"{prefix}.q_proj.weight"])])
    assert plain.pending_bytes == 0  # in order: hashed as it came, nothing kept
    plain.add([(f"{prefix}.v_proj.weight", tensors[f"{prefix}.v_proj.weight"])])
    assert plain.pending_bytes == tensors[f"{prefix}.v_proj.weight"].numel() * 2  # ahead of k: kept until k comes
    plain.add([(f"{prefix}.k_proj.weight", tensors[f"{prefix}.k_proj.weight"])])
    assert plain.pending_bytes == 0
    qkv = {f"{prefix}.{p}_proj.weight" for p in "qkv"}
    plain.add([(n, t) for n, t in tensors.items() if n not in qkv])
    assert plain.finish()[streamed] == expected_digests(tensors, None, streamed)


def test_a_group_never_completed_is_left_out():
    tensors = hf_tensors(TARGET_SHAPES, seed=4)
    of = layout(2, WeightLayout.AITER, draft=False)
    digester = EngineDigester(EngineDigestPlan(layouts=(of,)), names=tensors, selector=Selector.TARGET)
    digester.add([(n, t) for n, t in tensors.items() if not n.endswith("v_proj.weight")])
    per_rank = digester.finish()[of]
    assert all(QKV not in d and "model.layers.0.mlp.gate_up_proj.weight" in d for d in per_rank)


def test_selector_target_predicts_no_draft_digests(memory):
    target, draft = hf_tensors(TARGET_SHAPES, seed=5), hf_tensors(MTP_SHAPES, seed=6)
    info = ServerInfo(tp_size=2, model_path="/m", weight_layout="aiter", miles_sync_checksum_names=ChecksumNames.ENGINE)
    report = DraftReport(kind=DraftKind.MTP, owned_names=DRAFT_NAMES)
    frozen = engine_layout(info=info, config=CONFIG, draft=report, selector=Selector.TARGET)
    assert frozen.draft_names == ()
    assert engine_layout(info=info, config=CONFIG, draft=report, selector=Selector.ALL).draft_names == DRAFT_NAMES
    result = send(make_sender(target), selector=Selector.TARGET, plan=EngineDigestPlan(layouts=(frozen,)))
    assert result.engine_checksums[frozen] == expected_digests(target, None, frozen)
    # Even a plan that knows the draft's names computes nothing for it under 'target'.
    with_draft = layout(2, WeightLayout.AITER)
    result = send(
        make_sender({**target, **draft}), selector=Selector.TARGET, plan=EngineDigestPlan(layouts=(with_draft,))
    )
    assert not any(name.startswith("draft.") for d in result.engine_checksums[with_draft] for name in d)


# ---- the controller side: which engines have a layout model ---------------------------------------------------


def test_a_cpu_sglang_server_without_a_weight_layout_hashes_its_parameters_as_loaded():
    # What a real SGLang CPU server reports: no weight_layout, device "cpu" (its checker hashes the loaded bytes).
    server = ServerInfo(tp_size=2, model_path="/m", device="cpu")
    layout = engine_layout(info=server, config=CONFIG, draft=None, selector=Selector.ALL)
    assert layout.weight_layout is WeightLayout.NONE and layout.tp_size == 2
    # A reported layout wins over the device (the reference engine reports both).
    server = ServerInfo(tp_size=2, model_path="/m", device="cpu", weight_layout="aiter")
    assert (
        engine_layout(info=server, config=CONFIG, draft=None, selector=Selector.ALL).weight_layout is WeightLayout.AITER
    )


def test_a_cuda_sglang_server_is_modeled_with_the_gpu_hash_and_no_post_processing():
    # What a real SGLang GPU server reports: no weight_layout, device "cuda": its checker hashes each unquantized
    # dense parameter as loaded, with the Triton kernel (miles_sync.weights.gpu_hash).
    server = ServerInfo(tp_size=2, model_path="/m", device="cuda")
    layout = engine_layout(info=server, config=CONFIG, draft=None, selector=Selector.ALL)
    assert (layout.weight_layout, layout.tensor_hash, layout.tp_size) == (WeightLayout.NONE, TensorHash.GPU_HASH, 2)
    cpu = engine_layout(
        info=ServerInfo(model_path="/m", device="cpu"), config=CONFIG, draft=None, selector=Selector.ALL
    )
    assert cpu.tensor_hash is TensorHash.SHA256
    # The reference engine says how it hashes, whatever its device.
    reference = ServerInfo(model_path="/m", device="cpu", weight_layout="aiter", miles_sync_tensor_hash="gpu-hash")
    assert engine_layout(info=reference, config=CONFIG, draft=None, selector=Selector.ALL).tensor_hash is (
        TensorHash.GPU_HASH
    )


@pytest.mark.parametrize(
    ("info", "config", "reason"),
    [
        (dict(weight_layout=None), CONFIG, "reports neither its weight_layout nor its device"),
        (dict(weight_layout=None, device="xpu"), CONFIG, "a 'xpu' server's post-processing is not modeled"),
        (dict(weight_layout=None, device="cuda"), MOE_CONFIG, "may post-process its MoE experts"),
        (dict(weight_layout="marlin"), CONFIG, "weight_layout 'marlin' is not modeled"),
        (dict(weight_layout="none"), None, "no readable config.json under model_path '/m'"),
        (dict(weight_layout="none"), {**CONFIG, "model_type": "deepseek_v3"}, "model_type 'deepseek_v3'"),
        (dict(weight_layout="none"), {**CONFIG, "quantization_config": {"quant_method": "fp8"}}, "quantized"),
        (dict(weight_layout="none", tp_size=3), CONFIG, "num_attention_heads=4 is not divisible by tp_size=3"),
        (dict(weight_layout="none"), {k: v for k, v in CONFIG.items() if k != "vocab_size"}, "'vocab_size'"),
    ],
)
def test_engines_without_a_layout_model_name_why(info, config, reason):
    server = ServerInfo(**{"tp_size": 2, "model_path": "/m", **info})
    with pytest.raises(ValueError, match=reason):
        engine_layout(info=server, config=config, draft=None, selector=Selector.ALL)


class MemoryEngine:
    """An engine as the session sees it (EngineAPI), in memory: it loads what the transport carried and answers
    its weights checker as a TP>1 SGLang engine does, per rank and role, through the engine layout model."""

    def __init__(
        self,
        url: str,
        *,
        info: ServerInfo,
        weights: dict[str, torch.Tensor],
        transport: type[MemoryTransport],
        draft: DraftReport | None = None,
        draft_role: str = "draft_step_0",
        corrupt: tuple[int, str] | None = None,
        gpu_hash: bool = False,
    ) -> None:
        self.url, self.info, self._draft = url, info, draft
        self._weights, self._transport = dict(weights), transport
        self._draft_role, self._corrupt, self._gpu_hash = draft_role, corrupt, gpu_hash

    async def draft_report(self, *, timeout_s=None):
        return self._draft

    async def pause_generation(self, mode, *, timeout_s=None):
        return None

    async def flush_cache(self, *, server_wait_s=None, drain_s=None, timeout_s=None):
        return None

    async def begin_weight_update(self, selector, *, timeout_s=None):
        return None

    async def end_weight_update(self, *, timeout_s=None):
        self._weights.update(self._transport.instances[0].received())

    async def update_weight_version(self, new_version, *, abort_all_requests=False, timeout_s=None):
        return None

    async def continue_generation(self, *, torch_empty_cache=True, timeout_s=None):
        return None

    async def weights_checker(self, request, *, timeout_s=None):
        owned = set() if self._draft is None else set(self._draft.owned_names)
        roles = [("target", {n: t for n, t in self._weights.items() if not n.startswith("model.layers.1.")})]
        if self._draft is not None and len(selector_roles(request.selector)) == 2:
            roles.append((self._draft_role, {n: t for n, t in self._weights.items() if n in owned}))
        per_rank = rank_engine_digests(
            roles, shape=SHAPE, tp_size=self.info.tp_size, layout=WeightLayout(self.info.weight_layout or "none")
        )
        if self._corrupt is not None:
            rank, name = self._corrupt
            per_rank[rank][name] = "deadbeefdeadbeef"
        if self._gpu_hash:
            per_rank = tuple({n: d + "-triton" for n, d in r.items()} for r in per_rank)
        ranks = tuple(
            RankChecksums(
                checksums=checksums,
                per_gpu_checksum=sglang_overall_checksum(checksums),
                parallelism_info=tuple(
                    ParallelismInfo(
                        role=role,
                        tp_rank=r,
                        tp_size=len(per_rank),
                        dp_rank=0,
                        dp_size=1,
                        pp_rank=0,
                        pp_size=1,
                        rank=r,
                        size=len(per_rank),
                    )
                    for role, _ in roles
                ),
            )
            for r, checksums in enumerate(per_rank)
        )
        return WeightsCheckerResult(success=True, message="", ranks=ranks)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path)


def engine_info(model_dir: str, *, tp_size: int = 2, weight_layout: str | None = "aiter") -> ServerInfo:
    # Decoded as the client decodes /get_server_info: the reference engine's keys, unknown ones ignored.
    answer = {
        "model_path": model_dir,
        "tp_size": tp_size,
        "miles_sync_checksum_names": "engine",
        "draft_kind": "mtp",
        "version": "x",
        **({} if weight_layout is None else {"weight_layout": weight_layout}),
    }
    return decode(ServerInfo, answer, allow_unknown=True)


TRAINED_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=1, conversion_mode=ConversionMode.RAW
)
FROZEN_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)


def sync(engines, sender: Sender, *, inputs: SelectorInputs):
    async def main():
        await sender.open(engines=[EngineEndpoint(url=e.url, tp_size=e.info.tp_size) for e in engines], membership=None)
        try:
            return await run_sync_session(
                engines=engines,
                source=sender,
                version="1",
                previous_version="0",
                selector_inputs=inputs,
                pause_mode=PauseMode.RETRACT,
                verify=True,
                timeouts=SessionTimeouts(control_s=10.0, sync_s=60.0),
                transport_name="memory",
            )
        finally:
            await sender.close()

    return asyncio.run(main())


def test_a_session_verifies_tp2_engines_engine_exact_and_names_a_corrupted_shard(memory, model_dir):
    old = {**hf_tensors(TARGET_SHAPES, seed=7), **hf_tensors(MTP_SHAPES, seed=8)}
    new = {**hf_tensors(TARGET_SHAPES, seed=9), **hf_tensors(MTP_SHAPES, seed=10)}
    report = DraftReport(kind=DraftKind.MTP, owned_names=DRAFT_NAMES)

    def engines(corrupt=None):
        return [
            MemoryEngine(
                f"http://e{i}",
                info=engine_info(model_dir),
                weights=old,
                transport=memory,
                draft=report,
                corrupt=corrupt if i == 2 else None,
            )
            for i in range(3)
        ]

    good = sync(engines(), make_sender(new), inputs=TRAINED_DRAFT)
    assert good.committed and good.selector is Selector.ALL and good.verification == SHA256_EXACT, good.error
    assert all(e.verification == SHA256_EXACT and e.num_verified_tensors == len(new) for e in good.engines)
    assert "verification: engine-exact (sha256)" in good.summary()

    memory.instances.clear()
    bad = sync(engines(corrupt=(1, QKV)), make_sender(new), inputs=TRAINED_DRAFT)
    assert not bad.committed
    assert f"http://e2 (engine-exact (sha256)): rank 1 target {QKV} differs: expected " in bad.error
    failed = {e.url: e for e in bad.engines}["http://e2"]
    assert failed.is_stale and f"rank 1 target {QKV} differs" in failed.message
    assert all(e.success for e in bad.engines if e.url != "http://e2")


def test_a_frozen_draft_is_not_read_and_unmodeled_engines_fall_back(memory, model_dir):
    old, new = hf_tensors(TARGET_SHAPES, seed=11), hf_tensors(TARGET_SHAPES, seed=12)
    stale_draft = {**old, **hf_tensors(MTP_SHAPES, seed=13)}
    report = DraftReport(kind=DraftKind.MTP, owned_names=DRAFT_NAMES)
    engines = [
        # a draft it never receives, answered as corrupt: selector 'target' leaves it unread
        MemoryEngine(
            "http://a",
            info=engine_info(model_dir),
            weights=stale_draft,
            transport=memory,
            draft=report,
            corrupt=(0, "draft_step_0.model.layers.1.eh_proj.weight"),
        ),
        MemoryEngine("http://b", info=engine_info(model_dir, weight_layout=None), weights=old, transport=memory),
        MemoryEngine("http://c", info=engine_info(model_dir, tp_size=4), weights=old, transport=memory, gpu_hash=True),
    ]
    result = sync(engines, make_sender(new), inputs=FROZEN_DRAFT)
    assert result.committed and result.selector is Selector.TARGET, result.error
    methods = {e.url: e.verification for e in result.engines}
    # b reports no weight_layout (as SGLang), c (TP=4) answers GPU hashes: each is alone in its replica group
    assert methods == {"http://a": SHA256_EXACT, "http://b": UNVERIFIED, "http://c": UNVERIFIED}
    assert result.verification == "engine-exact (sha256)+unverified"


def test_plan_engine_digests_covers_only_engine_named_engines_with_a_model(model_dir):
    class Info:
        def __init__(self, url, info):
            self.url, self.info = url, info

        async def draft_report(self, *, timeout_s=None):
            return DraftReport(kind=DraftKind.MTP, owned_names=DRAFT_NAMES)

    hf = ServerInfo(tp_size=1, model_path=model_dir, weight_layout="none", miles_sync_checksum_names=ChecksumNames.HF)
    engines = [
        Info("http://tp2", engine_info(model_dir)),
        Info("http://tp2b", engine_info(model_dir)),
        Info("http://tp4", engine_info(model_dir, tp_size=4, weight_layout="none")),
        Info("http://sglang", engine_info("Qwen/Qwen3-0.6B", weight_layout=None)),
        Info("http://hf", hf),
    ]
    fleet = asyncio.run(plan_engine_digests(engines, selector=Selector.ALL, timeout_s=5.0))
    assert fleet.by_url["http://tp2"] == fleet.by_url["http://tp2b"] == layout(2, WeightLayout.AITER)
    assert fleet.by_url["http://tp4"] == layout(4, WeightLayout.NONE)
    assert fleet.plan.layouts == (layout(2, WeightLayout.AITER), layout(4, WeightLayout.NONE))
    assert set(fleet.fallbacks) == {"http://sglang"} and "weight_layout" in fleet.fallbacks["http://sglang"]


def test_answers_that_are_not_16_hex_digests_fall_back_to_the_replica_check():
    digests = ({"w": "00000000000000a1"}, {"w": "00000000000000a2"})

    def answer(suffix=""):
        return [
            RankChecksums(checksums={"w": d["w"] + suffix}, per_gpu_checksum="x", parallelism_info=()) for d in digests
        ]

    verdicts = fleet_verdicts(
        answers={"http://a": answer("-gpu"), "http://b": answer("-gpu"), "http://c": answer()},
        selector=Selector.TARGET,
        sent={"w": "sha"},
        hf_named=(),
        predicted={url: digests for url in ("http://a", "http://b", "http://c")},
    )
    assert verdicts["http://a"].method == verdicts["http://b"].method == REPLICA
    assert verdicts["http://c"].method == SHA256_EXACT and verdicts["http://c"].passed
