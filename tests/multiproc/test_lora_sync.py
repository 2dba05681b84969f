"""A LoRA sync through the real controller into a TP=1 and a TP=2 reference engine, each with a frozen MTP draft,
SGLang's finalize policy and the AITER layout (the configuration where a stray /end_weight_update re-shuffles the
base and the draft):

- the adapter reaches both engines checksum-verified by the engines themselves (expected_checksums: every TP rank
  checks the full tensors it received), as a dict payload and as a flattened bucket; rollouts naming the
  version's adapter get the merged model's greedy tokens;
- base and draft bytes are identical before and after every LoRA sync (the engines' SGLang-style checksums of
  their own parameters, fused names, physical AITER bytes, every role), while one begin/end session without a
  byte, what a LoRA sync must never do, changes them;
- a corrupted transfer fails the sync (no version bump) and the previous version's adapter keeps serving.

The adapter source here hands the controller PEFT tensors directly (the trainer-side export is covered by
test_lora_export.py and the main job).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from reference_server import reference_server
from test_lora_engine import TARGETS, _adapter, _config, _greedy, _merged
from transformers import AutoModelForCausalLM

from miles_sync.export.registry import ConversionMode
from miles_sync.sync.adapter import AdapterPayload, encode_adapter
from miles_sync.sync.controller import SyncController
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.sync.weight_source import WeightSource
from miles_sync.wire.protocol import PauseMode

# Slow: 17 s on a clean clone at 2d21038 (engines started per test or per TP size); the quick loop skips it.
pytestmark = pytest.mark.slow

PROMPT = (5, 17, 9, 33)


class _AdapterSource(WeightSource):
    """The trainer side of a LoRA sync as the controller sees it: `adapter_payload` and `release_adapter`."""

    syncs_adapters = True

    def __init__(self) -> None:
        self.named: dict[str, torch.Tensor] = {}
        self.flatten_min_bytes = 2**30
        self.corrupt = False
        self._kept: list[torch.Tensor] | None = None

    async def adapter_payload(self, *, tp_sizes) -> AdapterPayload:
        payload, self._kept = encode_adapter(
            self.named, config_dict=_config(), tp_sizes=tp_sizes, flatten_min_bytes=self.flatten_min_bytes
        )
        if self.corrupt:  # the bytes change after the checksums were taken: what a bad transfer does
            self._kept[0].view(-1)[0] += 1
        return payload

    async def release_adapter(self) -> None:
        self._kept = None

    async def close(self) -> None:
        pass


def _generate(server, lora_path: str, n: int = 5) -> tuple[int, object]:
    body = {"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": n, "temperature": 0.0}}
    return server.post("/generate", {**body, "lora_path": lora_path})


def _checksums(server) -> list:
    return server.ok("/weights_checker", {"action": "checksum"})["ranks"]


def test_lora_sync_verified_base_and_draft_untouched_corruption_keeps_previous(reference_checkpoints, tmp_path):
    base_model = AutoModelForCausalLM.from_pretrained(reference_checkpoints / "target", dtype=torch.float32).eval()
    lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *TARGETS, "--draft-is-frozen"]
    common = dict(
        model=reference_checkpoints / "target",
        draft_kind="mtp",
        finalize_policy="sglang",
        weight_layout="aiter",
        checksum_names="engine",
        log_dir=tmp_path,
    )
    with (
        reference_server(**common, extra_args=lora) as tp1,
        reference_server(**common, extra_args=[*lora, "--tp-size", "2"]) as tp2,
    ):
        servers = (tp1, tp2)
        baseline = [_checksums(s) for s in servers]
        source = _AdapterSource()
        controller = SyncController(
            engine_urls=[s.url for s in servers],
            source=source,
            transport="colocated",
            selector_inputs=SelectorInputs(
                mode=SelectorMode.AUTO,
                speculative_algorithm="NEXTN",
                num_trained_mtp_layers=0,
                conversion_mode=ConversionMode.RAW,
            ),
            pause_mode=PauseMode.ABORT,
            verify=True,
            timeouts=SessionTimeouts(control_s=60.0, sync_s=120.0),
            lora_name="policy",
            show_progress=False,
        )

        async def run(named, *, flatten: bool = False, corrupt: bool = False):
            source.named, source.corrupt = named, corrupt
            source.flatten_min_bytes = 0 if flatten else 2**30
            return await controller.sync(raise_on_failure=False)

        async def scenario():
            await controller.connect()
            first, second = _adapter(base_model, seed=1), _adapter(base_model, seed=2)
            reports = [
                await run(first),
                await run(second, flatten=True),
                await run(_adapter(base_model, seed=3), corrupt=True),
            ]
            await controller.close()
            return first, second, reports

        first, second, (one, two, bad) = asyncio.run(scenario())

        assert one.committed and two.committed, (one.error, two.error)
        for report in (one, two):
            assert report.verification == "engine-checksums+base-unchanged"
            assert all(e.num_verified_tensors == report.num_tensors > 0 for e in report.engines)
            assert report.num_bytes == sum(t.numel() * 4 for t in first.values())  # the adapter only, never the base
        tokens, _ = _greedy(_merged(base_model, second), PROMPT, 5)
        for server in servers:
            status, answer = _generate(server, "policy-v2")
            assert status == 200 and answer["output_ids"] == tokens
            assert _generate(server, "policy-v1")[0] == 400  # replaced: unloaded after v2 committed

        # The corrupted transfer: refused by the engines' own checksum check, no version, v2 still serving.
        assert not bad.committed and "[LORA-CHECK]" in bad.error
        assert not any(e.is_stale for e in bad.engines)
        for server in servers:
            status, answer = _generate(server, "policy-v2")
            assert status == 200 and answer["output_ids"] == tokens
            assert answer["meta_info"]["weight_version"] == "2"
            assert _generate(server, "policy-v3")[0] == 400

        # Base and draft: byte-identical through all three LoRA syncs ...
        assert [_checksums(s) for s in servers] == baseline
        # ... while a session that loads nothing (what a LoRA sync must never open) re-shuffles them under sglang.
        tp1.ok("/pause_generation", {"mode": "abort"})
        tp1.ok("/begin_weight_update", {"selector": "all"})
        tp1.ok("/end_weight_update", {})
        assert _checksums(tp1) != baseline[0]
