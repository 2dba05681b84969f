"""Block-FP8 syncs through a real reference engine serving the block-FP8 copy of the reference checkpoint (MTP
draft, AITER layout over the FP8 codes, strict finalize): a sender process quantizes after the "gather" and sends
(FP8 weight, float32 weight_scale_inv) units over a real gloo group; the sync verifies bit-exact and the engine's
answers equal the checksums of a fresh quantization of the same weights. A sync that would send unquantized
weights to that engine is refused before anything is sent, naming the tensor and both dtypes."""

from __future__ import annotations

import asyncio

import pytest
from reference_server import reference_server
from sender_host import SenderSettings, exported_names, load_checkpoint, weights_at_step

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.report import SyncError
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.weights.checksum import tensor_checksum
from miles_sync.weights.fp8 import Fp8Block, is_quantized_weight, quantize, scale_name
from miles_sync.weights.fp8_checkpoint import fp8_checkpoint
from miles_sync.wire.protocol import (
    GenerateRequest,
    PauseMode,
    SamplingParams,
    Selector,
    WeightsCheckerAction,
    WeightsCheckerRequest,
)

SPEC = Fp8Block(block=(32, 32))
TIMEOUTS = SessionTimeouts(control_s=20.0, sync_s=90.0)
FROZEN_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm="mtp", num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
PROMPT = GenerateRequest(input_ids=(3, 100, 7), sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0))


@pytest.fixture(scope="module")
def fp8_engine(reference_checkpoints, tmp_path_factory):
    model = fp8_checkpoint(reference_checkpoints / "target", SPEC)
    with reference_server(
        model=model,
        log_dir=tmp_path_factory.mktemp("fp8-engine"),
        draft_kind="mtp",
        weight_layout="aiter",
        extra_args=("--collective-timeout-s", "15"),
    ) as server:
        yield server


def controller(url: str, source, *, quantization: Fp8Block | None, transport: str = "distributed") -> SyncController:
    return SyncController(
        engine_urls=[url],
        source=source,
        transport=transport,
        selector_inputs=FROZEN_DRAFT,
        pause_mode=PauseMode.RETRACT,
        verify=True,
        timeouts=TIMEOUTS,
        show_progress=False,
        quantization=quantization,
    )


async def target_checksums(url: str) -> dict[str, str]:
    async with EngineClient(url, timeout_s=20.0) as client:
        result = await client.weights_checker(
            WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.TARGET)
        )
    return dict(result.ranks[0].checksums)


def expected_checksums(reference_checkpoints, *, step: int) -> dict[str, str]:
    """What a block-FP8 sync of the weights at `step` sends, recomputed here: FP8 codes and scales of every
    quantized weight, every other tensor as it is."""
    tensors, num_layers = load_checkpoint(reference_checkpoints / "target")
    weights = weights_at_step(tensors, step)
    expected = {}
    for name in exported_names(weights, num_hidden_layers=num_layers, include_mtp=False):
        if is_quantized_weight(name):
            codes, scales = quantize(weights[name], SPEC.block)
            expected[name], expected[scale_name(name)] = tensor_checksum(codes), tensor_checksum(scales)
        else:
            expected[name] = tensor_checksum(weights[name])
    return expected


def test_fp8_sync_is_verified_bit_exact_and_a_mismatch_is_refused_before_sending(
    fp8_engine, source, reference_checkpoints
):
    url = fp8_engine.url

    async def main():
        async with EngineClient(url, timeout_s=20.0) as client:
            info = await client.connect()
        await source.call(
            "configure", SenderSettings(transport="distributed", bucket_bytes=256 * 1024, include_mtp=False)
        )
        before = await target_checksums(url)
        plain = controller(url, source, quantization=None)  # the engine serves FP8: refused, nothing sent
        await plain.connect()
        try:
            with pytest.raises(SyncError) as refused:
                await plain.sync()
        finally:
            await plain.close()
        untouched = await target_checksums(url)
        await source.call(
            "configure",
            SenderSettings(transport="distributed", bucket_bytes=256 * 1024, include_mtp=False, quantization=SPEC),
        )
        await source.call("step", 1)
        ctl = controller(url, source, quantization=SPEC)
        await ctl.connect()
        try:
            report = await ctl.sync()
        finally:
            await ctl.close()
        after = await target_checksums(url)
        # The colocated path (shared-memory tensor payloads) carries the same FP8 units.
        await source.call(
            "configure",
            SenderSettings(transport="colocated", bucket_bytes=256 * 1024, include_mtp=False, quantization=SPEC),
        )
        await source.call("step", 2)
        colocated = controller(url, source, quantization=SPEC, transport="colocated")
        await colocated.connect()
        try:
            second = await colocated.sync()
        finally:
            await colocated.close()
        async with EngineClient(url, timeout_s=60.0) as client:
            served = await client.generate(PROMPT)
        return info, before, refused.value.report, untouched, report, after, second, await target_checksums(url), served

    info, before, refused, untouched, report, after, second, after_second, served = asyncio.run(main())
    assert info.quantization == "fp8" and tuple(info.weight_block_size) == (32, 32) and info.dtype == "float32"
    first = "model.layers.0.mlp.down_proj.weight"  # the first quantized weight this source exports
    assert not refused.committed and refused.num_bytes == 0 and not any(e.is_stale for e in refused.engines)
    assert "quantization mismatch, nothing was sent" in refused.error
    assert f"serves {first} as float8_e4m3fn" in refused.error and "send it as float32" in refused.error
    assert untouched == before
    assert report.committed and report.error is None and report.engines[0].verification == "exact"
    expected = expected_checksums(reference_checkpoints, step=1)
    assert after == expected and after != before
    assert report.num_tensors == len(expected) and report.engines[0].num_verified_tensors == len(expected)
    assert second.committed and second.engines[0].verification == "exact"
    assert after_second == expected_checksums(reference_checkpoints, step=2) != after
    assert served.meta_info.weight_version == second.version
