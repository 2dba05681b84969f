"""A trainer-side process for multi-process sync tests: it holds a real model's tensors and runs a real Sender.

The model is the reference target checkpoint (with its MTP layer); a "training step" s adds a deterministic
perturbation, so every step has new weights whose checksums the test can recompute on its own. The test process
drives the sender through `ProcessSource`, a WeightSource over a pipe (the process boundary a Ray actor call would
be), with requests tagged so that an answer to a cancelled request is never taken for the next one.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_sync.engine.reference.ranks import wait_exited
from miles_sync.export.units import ExportedUnit, units_from_hf_tensors
from miles_sync.sync.weight_source import WeightSource

_PERTURBATION = 1e-4  # small enough that generation quality survives a few steps


@dataclass(frozen=True, kw_only=True)
class SenderSettings:
    transport: str
    bucket_bytes: int
    include_mtp: bool  # False: the MTP layer is frozen and never exported (raw mode without trained MTP layers)
    skip_names: tuple[str, ...] = ()  # tensors a faulty exporter would drop
    extra_names: tuple[str, ...] = ()  # small tensors (4 float32 ones) a faulty exporter would add under these names
    # Colocated: plan the feeds from devices (this process and every engine rank on one device), as a placed
    # trainer rank does, instead of the source-feeds-all default.
    plan_feeds: bool = False
    # False: ignore the controller's engine-digest plan (as a source that cannot predict engine digests would), so
    # engines answering engine names are checked by replica agreement.
    predict_engine_digests: bool = True
    quantization: Any = None  # a miles_sync.weights.fp8.Fp8Block: the sender quantizes to block FP8
    flush_cache: bool = False  # every update request flushes the engine's prefix cache (no session flush)
    api_key: str | None = field(default=None, repr=False)  # the engines' keys, for the sender's own calls
    admin_api_key: str | None = field(default=None, repr=False)
    bucket_timeout_s: float = 20.0
    open_timeout_s: float = 20.0
    http_timeout_s: float = 20.0

    def sender_settings(self, settings_class: type[Any]) -> Any:
        """The Sender's own settings record (miles_sync.sync.sender.SenderSettings, imported in the host process)
        for these; `call_timeout_s` bounds a whole call, as a trainer rank's does."""
        return settings_class(
            transport=self.transport,
            bucket_bytes=self.bucket_bytes,
            bucket_timeout_s=self.bucket_timeout_s,
            open_timeout_s=self.open_timeout_s,
            http_timeout_s=self.http_timeout_s,
            call_timeout_s=self.open_timeout_s + self.bucket_timeout_s,
            quantization=self.quantization,
            flush_cache=self.flush_cache,
            api_key=self.api_key,
            admin_api_key=self.admin_api_key,
        )


def load_checkpoint(target_dir: Path) -> tuple[dict[str, torch.Tensor], int]:
    """Tensors of the target checkpoint and its num_hidden_layers (the MTP layer is layer num_hidden_layers)."""
    import json

    from miles_sync.engine.reference.models import read_safetensors

    config = json.loads((target_dir / "config.json").read_text())
    return read_safetensors(target_dir / "model.safetensors"), int(config["num_hidden_layers"])


def weights_at_step(tensors: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """The weights after `step` training steps (step 0: the checkpoint). Deterministic in (name order, step)."""
    if step == 0:
        return dict(tensors)
    generator = torch.Generator().manual_seed(step)
    return {
        name: t + _PERTURBATION * torch.randn(t.shape, generator=generator, dtype=t.dtype)
        for name, t in sorted(tensors.items())
    }


def exported_names(
    tensors: dict[str, torch.Tensor], *, num_hidden_layers: int, include_mtp: bool, skip_names: Sequence[str] = ()
) -> list[str]:
    mtp_prefix = f"model.layers.{num_hidden_layers}."
    return [n for n in sorted(tensors) if (include_mtp or not n.startswith(mtp_prefix)) and n not in skip_names]


def export_units(
    tensors: dict[str, torch.Tensor], *, num_hidden_layers: int, include_mtp: bool, skip_names: Sequence[str] = ()
) -> list[ExportedUnit]:
    """Atomic units the way a converter emits them: a layer's q/k/v together, gate/up together, others alone."""
    names = exported_names(tensors, num_hidden_layers=num_hidden_layers, include_mtp=include_mtp, skip_names=skip_names)
    return units_from_hf_tensors(tensors, names)


def run(conn, target_dir: str, gate_reached, gate_release) -> None:
    """Process entry point (spawn)."""
    torch.set_num_threads(1)
    asyncio.run(_serve(conn, Path(target_dir), gate_reached, gate_release))


async def _serve(conn, target_dir: Path, gate_reached, gate_release) -> None:
    from miles_sync.sync.sender import Sender
    from miles_sync.sync.sender import SenderSettings as Settings  # this module's SenderSettings is the test's own
    from miles_sync.transport.feeds import Device, FeedRole, plan_feeds
    from miles_sync.wire.bucket import TensorMeta

    checkpoint, num_hidden_layers = load_checkpoint(target_dir)
    state: dict[str, Any] = {"step": 0, "gate_unit": None, "sender": None, "settings": None}

    def with_extras(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**tensors, **{name: torch.ones(4) for name in state["settings"].extra_names}}

    def export():
        units = export_units(
            with_extras(weights_at_step(checkpoint, state["step"])),
            num_hidden_layers=num_hidden_layers,
            include_mtp=state["settings"].include_mtp,
            skip_names=state["settings"].skip_names,
        )
        for index, unit in enumerate(units):
            if index == state["gate_unit"]:
                state["gate_unit"] = None
                gate_reached.set()
                gate_release.wait(60.0)
            yield unit

    def names():
        settings = state["settings"]
        return exported_names(
            with_extras(checkpoint),
            num_hidden_layers=num_hidden_layers,
            include_mtp=settings.include_mtp,
            skip_names=settings.skip_names,
        )

    def metas():
        tensors = with_extras(checkpoint)
        return [TensorMeta(name=n, shape=tuple(tensors[n].shape), dtype=tensors[n].dtype) for n in names()]

    def feeds(settings: SenderSettings, engines) -> FeedRole | None:
        if not settings.plan_feeds:
            return None
        device = Device(node="127.0.0.1", index=0)
        plan = plan_feeds(trainer_devices=[device], engine_devices=[[device] * e.tp_size for e in engines])
        return FeedRole(plan=plan, rank=0, source_rank=0)

    def make_sender(settings: SenderSettings, *, feeds: FeedRole | None) -> Sender:
        return Sender(settings=settings.sender_settings(Settings), export=export, names=names, feeds=feeds, metas=metas)

    while True:
        request_id, op, args = await asyncio.to_thread(conn.recv)
        try:
            if op == "configure":
                if state["sender"] is not None:
                    await state["sender"].close()
                settings: SenderSettings = args
                state["settings"] = settings
                state["sender"] = make_sender(settings, feeds=None)
                result = None
            elif op == "step":
                state["step"] = args
                result = None
            elif op == "gate":
                state["gate_unit"] = args
                result = None
            elif op == "names":
                result = await state["sender"].exported_names()
            elif op == "open":
                settings = state["settings"]
                if settings.plan_feeds:  # the plan needs the engines' TP sizes: rebuild the sender with it
                    await state["sender"].close()
                    state["sender"] = make_sender(settings, feeds=feeds(settings, args[0]))
                result = await state["sender"].open(engines=args[0], membership=args[1])
            elif op == "send":
                selector, engine_digests = args
                result = await state["sender"].send(
                    selector=selector,
                    engine_digests=engine_digests if state["settings"].predict_engine_digests else None,
                    on_bucket=lambda progress, request_id=request_id: conn.send((request_id, "progress", progress)),
                )
            elif op == "stage":
                selector, engine_digests = args
                if not state["settings"].predict_engine_digests:
                    engine_digests = None
                result = await state["sender"].stage(selector=selector, engine_digests=engine_digests)
            elif op == "predict":
                selector, engine_digests = args
                result = await state["sender"].predict(selector=selector, engine_digests=engine_digests)
            elif op == "close":
                result = None if state["sender"] is None else await state["sender"].close()
            elif op == "exit":
                conn.send((request_id, "ok", None))
                return
            else:
                raise ValueError(f"unknown op {op!r}")
            conn.send((request_id, "ok", result))
        except Exception as exc:
            conn.send((request_id, "error", f"{type(exc).__name__}: {exc}"))


class ProcessSource(WeightSource):
    """WeightSource for a sender in another process; each call waits at most `timeout_s`."""

    can_stage = True
    can_predict = True

    def __init__(self, *, target_dir: Path, timeout_s: float = 120.0) -> None:
        context = multiprocessing.get_context("spawn")
        self.gate_reached = context.Event()
        self.gate_release = context.Event()
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=run, args=(child, str(target_dir), self.gate_reached, self.gate_release), daemon=True
        )
        self.process.start()
        child.close()
        self._timeout_s = timeout_s
        self._next_id = 0
        self._lock = asyncio.Lock()
        self.stage_results: list[Any] = []  # every StageResult, in order

    async def call(self, op: str, args: Any = None, *, on_progress: Callable | None = None) -> Any:
        if op == "configure":  # the session reads it here, on this side of the pipe
            self.flushes_cache = args.flush_cache
        async with self._lock:
            self._next_id += 1
            request_id = self._next_id
            self._conn.send((request_id, op, args))
            deadline = time.monotonic() + self._timeout_s
            while True:
                if not await asyncio.to_thread(self._conn.poll, 0.2):
                    if not self.process.is_alive():
                        raise RuntimeError(f"sender process died (exit code {self.process.exitcode})")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"sender op {op!r} got no answer within {self._timeout_s} s")
                    continue
                answer_id, kind, payload = self._conn.recv()
                if answer_id != request_id:
                    continue  # the answer to a request whose caller gave up
                if kind == "progress":
                    if on_progress is not None:
                        on_progress(payload)
                    continue
                if kind == "error":
                    raise RuntimeError(payload)
                return payload

    # ---- WeightSource -------------------------------------------------------------------------------------------

    async def exported_names(self) -> tuple[str, ...]:
        return tuple(await self.call("names"))

    async def open(self, *, engines: Sequence, membership):
        return await self.call("open", (tuple(engines), membership))

    async def send(self, *, selector, on_bucket=None, engine_digests=None):
        return await self.call("send", (selector, engine_digests), on_progress=on_bucket)

    async def stage(self, *, selector=None, engine_digests=None):
        result = await self.call("stage", (selector, engine_digests))
        self.stage_results.append(result)
        return result

    async def predict(self, *, selector, engine_digests=None):
        return await self.call("predict", (selector, engine_digests))

    async def close(self) -> None:
        await self.call("close")

    def shutdown(self) -> None:
        try:
            self._conn.send((0, "exit", None))
        except OSError:
            pass  # already gone
        if not wait_exited(self.process, 10.0):  # not join(): see wait_exited
            self.process.kill()
            wait_exited(self.process, 10.0)
