"""The one session frame under both sync kinds (miles_sync.sync.frame): a full sync and a LoRA sync, driven into the
same two reference engines, treat a held engine the same way. Engine A is held (paused since an earlier failure),
engine B serves. A sync of either kind that fails leaves A paused and B serving; a sync of either kind that
completes resumes A. The engines are real (LoRA-enabled reference servers); the full sync's source is a real
Sender in another process (colocated transport), the LoRA sync's payload real PEFT tensors."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from reference_server import reference_server
from sender_host import ProcessSource, SenderSettings
from test_lora_engine import TARGETS, _adapter, _config
from transformers import AutoModelForCausalLM

from miles_sync.engine.client import EngineClient
from miles_sync.export.registry import ConversionMode
from miles_sync.sync.adapter import encode_adapter
from miles_sync.sync.lora import run_lora_sync_session
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts, run_sync_session
from miles_sync.sync.weight_source import WeightSource
from miles_sync.transport.membership import EngineEndpoint
from miles_sync.wire.protocol import GenerateRequest, PauseMode, SamplingParams

pytestmark = pytest.mark.multiproc

TIMEOUTS = SessionTimeouts(control_s=20.0, sync_s=90.0)
NO_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm=None, num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)
PROBE = GenerateRequest(input_ids=(5, 17, 9), sampling_params=SamplingParams(max_new_tokens=2, temperature=0.0))


class ExportFails(WeightSource):
    """A trainer whose export fails: the full sync fails before anything is sent."""

    async def exported_names(self) -> tuple[str, ...]:
        raise RuntimeError("the export failed on the trainer")

    async def close(self) -> None:
        return None


async def serving(client: EngineClient) -> bool:
    """A paused engine queues a generation: it does not answer within a few seconds."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(client.generate(PROBE), timeout=3.0)
        return True
    return False


def test_a_held_engine_is_kept_and_resumed_alike_by_full_and_lora_syncs(reference_checkpoints, tmp_path):
    lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *TARGETS]
    common = dict(model=reference_checkpoints / "target", log_dir=tmp_path, extra_args=lora)
    base = AutoModelForCausalLM.from_pretrained(reference_checkpoints / "target", dtype=torch.float32).eval()
    adapter = _adapter(base, seed=1)
    source = ProcessSource(target_dir=reference_checkpoints / "target")
    with reference_server(**common) as a, reference_server(**common) as b:

        async def main():
            clients = [EngineClient(s.url, timeout_s=20.0) for s in (a, b)]
            for client in clients:
                await client.connect()
            held = (a.url,)
            kept: list[torch.Tensor] = []

            async def payload(*, fail: bool):
                if fail:
                    raise RuntimeError("the adapter export failed on the trainer")
                encoded, tensors = encode_adapter(adapter, config_dict=_config(), tp_sizes=[1], flatten_min_bytes=2**30)
                kept.extend(tensors)
                return encoded

            async def full(version: str, *, fail: bool):
                if fail:
                    chosen = ExportFails()
                else:
                    chosen = source
                    await source.call(
                        "configure", SenderSettings(transport="colocated", bucket_bytes=2**20, include_mtp=False)
                    )
                    await source.open(engines=[EngineEndpoint(url=c.url, tp_size=1) for c in clients], membership=None)
                return await run_sync_session(
                    engines=clients,
                    source=chosen,
                    version=version,
                    previous_version="0",
                    selector_inputs=NO_DRAFT,
                    pause_mode=PauseMode.ABORT,
                    verify=True,
                    timeouts=TIMEOUTS,
                    transport_name="colocated",
                    held=held,
                )

            async def lora(version: str, *, fail: bool):
                return await run_lora_sync_session(
                    engines=clients,
                    tp_sizes={c.url: 1 for c in clients},
                    payload=lambda: payload(fail=fail),
                    name="policy",
                    version=version,
                    previous_version="0",
                    pause_mode=PauseMode.ABORT,
                    timeouts=TIMEOUTS,
                    held=held,
                )

            outcomes = {}
            try:
                for kind, sync in (("full", full), ("lora", lora)):
                    await clients[0].pause_generation(PauseMode.ABORT)  # A: held since an "earlier failure"
                    failed = await sync("1", fail=True)
                    after_failure = [await serving(c) for c in clients]
                    passed = await sync("2", fail=False)
                    after_success = [await serving(c) for c in clients]
                    outcomes[kind] = (failed, after_failure, passed, after_success)
            finally:
                await source.close()
                for client in clients:
                    await client.close()
            return outcomes

        try:
            outcomes = asyncio.run(main())
        finally:
            source.shutdown()

    for kind, (failed, after_failure, passed, after_success) in outcomes.items():
        assert not failed.committed and "export failed on the trainer" in failed.error, (kind, failed.error)
        assert [e.is_stale for e in failed.engines] == [True, False], kind
        assert "held paused since an earlier failed sync" in failed.engines[0].message, kind
        assert after_failure == [False, True], kind  # A kept paused, B serving
        assert passed.committed, (kind, passed.error)
        assert [e.is_stale for e in passed.engines] == [False, False] and after_success == [True, True], kind
    assert outcomes["full"][2].verification == "exact"
    assert outcomes["lora"][2].verification == "engine-checksums+base-unchanged"
