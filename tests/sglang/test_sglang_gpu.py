"""A real SGLang 0.5.23 server on a GPU: its checker hashes with the Triton kernel, and a sync predicts that hash on
the sender (miles_sync.weights.gpu_hash), so it commits `engine-exact (gpu-hash)`. Needs a CUDA device and an
SGLang install that can use it (`gpu` marker: skipped elsewhere, as on CI); the GPU hash itself is checked on every
machine against SGLang's own kernels (tests/unit/test_gpu_hash.py)."""

from __future__ import annotations

import asyncio

import pytest
from sender_host import SenderSettings
from sglang_server import sglang_server

from miles_sync.export.registry import ConversionMode
from miles_sync.sync.controller import SyncController
from miles_sync.sync.selector import SelectorMode
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.wire.protocol import PauseMode

pytestmark = pytest.mark.gpu

NO_DRAFT = SelectorInputs(
    mode=SelectorMode.AUTO, speculative_algorithm=None, num_trained_mtp_layers=0, conversion_mode=ConversionMode.RAW
)


def test_a_gpu_server_is_verified_engine_exact_with_its_triton_hash(
    reference_checkpoints, sglang_python, source, tmp_path
):
    model = reference_checkpoints / "target"
    with sglang_server(model=model, python=sglang_python, log_dir=tmp_path, device="cuda") as server:

        async def main():
            await source.call(
                "configure", SenderSettings(transport="distributed", bucket_bytes=512 * 1024, include_mtp=False)
            )
            ctl = SyncController(
                engine_urls=[server.url],
                source=source,
                transport="distributed",
                selector_inputs=NO_DRAFT,
                pause_mode=PauseMode.ABORT,
                verify=True,
                timeouts=SessionTimeouts(control_s=60.0, sync_s=300.0),
                show_progress=False,
            )
            await ctl.connect()
            try:
                check = await ctl.check_engines()  # the server loaded the checkpoint the source starts from
                await source.call("step", 1)
                return check, await ctl.sync()
            finally:
                await ctl.close()

        check, report = asyncio.run(main())
    assert check.to_sync == () and check.engines[0].method == "engine-exact (gpu-hash)", check.summary()
    assert report.committed and report.verification == "engine-exact (gpu-hash)", report
