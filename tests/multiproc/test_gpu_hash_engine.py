"""Engine-exact verification of engines that hash as SGLang's GPU servers do: the reference engine's
`--tensor-hash gpu-hash` mode answers its checker with SGLang's Triton tensor hash (computed on the CPU by
miles_sync.weights.gpu_hash), and reports it as a CUDA server's device would imply. A sync predicts that hash on the
sender and commits `engine-exact (gpu-hash)` per rank at TP=1 and TP=2 (AITER layout, frozen MTP draft); a shard
corrupted on one rank is named by rank, role and parameter."""

from __future__ import annotations

import asyncio
import json

import pytest
from reference_server import checkpoint_tensors, tp_fleet
from sender_host import SenderSettings, load_checkpoint, weights_at_step

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.sync.verify import engine_exact_problems
from miles_sync.weights.checksum import TensorHash
from miles_sync.weights.engine_layout import TPShape, rank_engine_digests
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.payload import encode_named_tensors
from miles_sync.wire.protocol import PauseMode, Selector, WeightsCheckerAction, WeightsCheckerRequest

# Slow: 17 s on a clean clone at 2d21038 (engines started per test or per TP size); the quick loop skips it.
pytestmark = pytest.mark.slow

TIMEOUTS = SessionTimeouts(control_s=20.0, sync_s=90.0)
FROZEN_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)


@pytest.fixture(scope="module")
def engines(reference_checkpoints, tmp_path_factory):
    """[TP=1, TP=2] reference engines answering SGLang's GPU tensor hash over engine parameters."""
    with tp_fleet(
        model=reference_checkpoints / "target",
        log_dir=tmp_path_factory.mktemp("gpu-hash-engines"),
        tp_sizes=(1, 2),
        extra_args=["--tensor-hash", "gpu-hash"],
        draft_kind="mtp",
        weight_layout="aiter",
        checksum_names="engine",
    ) as engines:
        yield engines


def expected_answers(weights, *, config, tp_size: int, kind: TensorHash) -> tuple[dict[str, str], ...]:
    """Per rank, what a faithful engine hashing with `kind` answers for the target's full HF weights."""
    prefix = f"model.layers.{config['num_hidden_layers']}."
    target = {n: t for n, t in weights.items() if not n.startswith(prefix)}
    shape = TPShape.from_config(config)
    return rank_engine_digests(
        [("target", target)], shape=shape, tp_size=tp_size, layout=WeightLayout.AITER, tensor_hash=kind
    )


async def checker_ranks(url: str):
    client = EngineClient(url, timeout_s=60.0)
    try:
        request = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.TARGET)
        return (await client.weights_checker(request, timeout_s=60.0)).ranks
    finally:
        await client.close()


def test_a_sync_into_gpu_hash_engines_commits_engine_exact_gpu_hash_per_rank(engines, source, reference_checkpoints):
    urls = [engine.url for engine in engines]
    assert [e.get("/get_server_info")[1]["miles_sync_tensor_hash"] for e in engines] == ["gpu-hash"] * 2

    async def main():
        await source.call(
            "configure", SenderSettings(transport="distributed", bucket_bytes=256 * 1024, include_mtp=False)
        )
        ctl = SyncController(
            engine_urls=urls,
            source=source,
            transport="distributed",
            selector_inputs=FROZEN_DRAFT,
            pause_mode=PauseMode.RETRACT,
            verify=True,
            timeouts=TIMEOUTS,
            show_progress=False,
        )
        await ctl.connect()
        try:
            await source.call("step", 3)
            return await ctl.sync(), [await checker_ranks(url) for url in urls]
        finally:
            await ctl.close()

    report, answers = asyncio.run(main())
    assert report.committed and report.selector is Selector.TARGET, report.error
    assert [e.verification for e in report.engines] == ["engine-exact (gpu-hash)"] * 2
    assert all(e.num_verified_tensors == report.num_tensors > 0 for e in report.engines)
    tensors, _ = load_checkpoint(reference_checkpoints / "target")
    config = json.loads((reference_checkpoints / "target" / "config.json").read_text())
    weights = weights_at_step(tensors, 3)
    for tp, ranks in zip((1, 2), answers):
        expected = expected_answers(weights, config=config, tp_size=tp, kind=TensorHash.GPU_HASH)
        assert [dict(r.checksums) for r in ranks] == list(expected)
        # The SHA-256 answer of the same bytes differs everywhere: the engines really answer the GPU hash.
        sha = expected_answers(weights, config=config, tp_size=tp, kind=TensorHash.SHA256)
        assert all(sha[r][n] != expected[r][n] for r in range(tp) for n in expected[r])


def test_a_corrupted_shard_on_one_gpu_hash_rank_is_named(engines, reference_checkpoints):
    """Rank 1 of the TP=2 engine loads a q_proj that differs in its own slice: only its fused qkv_proj differs."""
    tp2 = engines[1]
    tensors = checkpoint_tensors(reference_checkpoints / "target")
    prefix = "model.layers.1.self_attn."
    good = [(prefix + f"{p}_proj.weight", tensors[prefix + f"{p}_proj.weight"]) for p in "qkv"]
    bad = [(name, t.clone()) for name, t in good]
    bad[0][1][-1, 0] += 1.0  # the last row of q belongs to rank 1's slice

    def session(payloads) -> None:
        tp2.ok("/begin_weight_update", {"selector": "target"})
        try:
            tp2.ok("/update_weights_from_tensor", {"serialized_named_tensors": payloads, "selector": "target"})
        finally:
            tp2.post("/end_weight_update")

    session([encode_named_tensors(good) for _ in range(2)])
    baseline = [dict(r.checksums) for r in asyncio.run(checker_ranks(tp2.url))]
    try:
        session([encode_named_tensors(good), encode_named_tensors(bad)])
        answer = asyncio.run(checker_ranks(tp2.url))
        problems, _ = engine_exact_problems(expected=baseline, ranks=answer, selector=Selector.TARGET, sent_names=())
        assert len(problems) == 1 and problems[0].startswith(f"rank 1 target {prefix}qkv_proj.weight differs"), problems
    finally:
        session([encode_named_tensors(good) for _ in range(2)])
