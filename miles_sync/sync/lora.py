"""LoRA sync: only the adapter travels, through SGLang's `/load_lora_adapter_from_tensors`; the base never does.

    payload = encode_adapter(named, config_dict=..., tp_sizes={1, 2}, flatten_min_bytes=...)   # trainer's source
    report = await run_lora_sync_session(engines=..., payload=payload, name="policy", version="3", ...)

The flow of one LoRA sync, read from SGLang 0.5.23's source:

    pause (barrier) -> flush (unless in_place) -> [base/draft checksums] -> load the adapter as <name>-v<version>
    -> version -> [base/draft checksums again: unchanged] -> unload the previous version's adapter
    continue_generation on every engine that may serve, also on failure

- No begin/end session: SGLang's adapter load is its own scheduler request (tp_worker.load_lora_adapter_from_tensors)
  that never enters a weight-update session, carries no selector and is applied by the target's LoRA manager only;
  an /end_weight_update would run post-load processing on runners that received nothing (with the AITER layout
  the base, and the frozen draft, would be shuffled again: the bug class of shared/seeds). So a LoRA sync never
  calls begin/end and touches no base or draft byte.
- SGLang refuses to load a name that is already loaded ("already loaded"), so replacing an adapter in place is
  unload + load, and a failed load would leave no adapter at all. Each version is therefore loaded under its own
  name (`adapter_name`) and the previous one unloaded only after the new one committed: a corrupted transfer,
  refused by the engine, leaves the previous adapter serving and the engine in service.
- The engine verifies: `expected_checksums` (SHA-256 of each full tensor, which every TP rank receives whole and
  checks itself before slicing) makes the engine refuse a corrupted transfer.
- The version is committed only when every engine loaded the adapter and took the version.

Payloads: one per engine TP rank, each the full adapter: a pickled dict {name: tensor} (SGLang's adapter format),
or, from `flatten_min_bytes` on, one flattened bucket (load_format "flattened_bucket"). CPU tensors travel as
shared-memory handles: the engines must run on the source's host, and the source keeps the tensors alive until the
session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_sync.sync.report import EngineResult, PhaseTimes, SyncReport
from miles_sync.sync.session import SessionTimeouts
from miles_sync.sync.verify import weights_digest
from miles_sync.weights.checksum import raw_sha256
from miles_sync.wire.api import EngineAPI
from miles_sync.wire.bucket import pack_bucket
from miles_sync.wire.payload import FlattenedTensorMetadata, encode_flattened_bucket, encode_named_tensor_dict
from miles_sync.wire.protocol import (
    LoadFormat,
    LoadLoRAAdapterFromTensorsRequest,
    PauseMode,
    Selector,
    UnloadLoRAAdapterRequest,
    WeightsCheckerAction,
    WeightsCheckerRequest,
)

__all__ = [
    "LORA_TRANSPORT",
    "AdapterPayload",
    "adapter_name",
    "adapter_sha256",
    "encode_adapter",
    "run_lora_sync_session",
]

LORA_TRANSPORT = "lora"  # the report's transport name


def adapter_sha256(tensor: torch.Tensor) -> str:
    """SGLang's adapter checksum: plain SHA-256 hex of the tensor's raw bytes."""
    return raw_sha256(tensor)


@dataclass(frozen=True, kw_only=True)
class AdapterPayload:
    """One adapter version, encoded for engines of each TP size in `payloads` (tp_size -> one payload per rank).
    Crosses the Ray boundary from the trainer's source rank to the controller; the tensors it names stay alive in
    the source until it is told the session ended."""

    config_dict: dict[str, Any]
    load_format: LoadFormat | None
    payloads: dict[int, tuple[str, ...]]
    checksums: dict[str, str]
    num_bytes: int
    num_tensors: int

    def request(self, *, name: str, tp_size: int) -> LoadLoRAAdapterFromTensorsRequest:
        if tp_size not in self.payloads:
            raise ValueError(f"the adapter was encoded for TP sizes {sorted(self.payloads)}, not {tp_size}")
        return LoadLoRAAdapterFromTensorsRequest(
            lora_name=name,
            config_dict=self.config_dict,
            serialized_named_tensors=self.payloads[tp_size],
            load_format=self.load_format,
            expected_checksums=self.checksums,
        )


def encode_adapter(
    named: Mapping[str, torch.Tensor],
    *,
    config_dict: Mapping[str, Any],
    tp_sizes: Iterable[int],
    flatten_min_bytes: int,
) -> tuple[AdapterPayload, list[torch.Tensor]]:
    """The payload of `named` (PEFT names -> full tensors) for engines of each TP size, and the tensors the caller
    must keep alive until every engine answered (the payloads are handles to their memory)."""
    if not named:
        raise ValueError("the adapter has no tensors: nothing would be sent")
    pairs = [(n, t.detach().contiguous()) for n, t in named.items()]
    num_bytes = sum(t.numel() * t.element_size() for _, t in pairs)
    checksums = {n: adapter_sha256(t) for n, t in pairs}
    is_flat = num_bytes >= flatten_min_bytes
    if is_flat:
        bucket = pack_bucket(pairs)
        metadata = [
            FlattenedTensorMetadata(
                name=e.name, shape=tuple(e.shape), dtype=e.dtype, start_idx=e.start, end_idx=e.end, numel=e.num_bytes
            )
            for e in bucket.entries
        ]
        kept = [bucket.buffer]

        def one() -> str:
            return encode_flattened_bucket(buffer=bucket.buffer, metadata=metadata)
    else:
        kept = [t for _, t in pairs]

        def one() -> str:
            return encode_named_tensor_dict(pairs)

    payloads = {tp: tuple(one() for _ in range(tp)) for tp in sorted(set(tp_sizes))}
    payload = AdapterPayload(
        config_dict=dict(config_dict),
        load_format=LoadFormat.FLATTENED_BUCKET if is_flat else None,
        payloads=payloads,
        checksums=checksums,
        num_bytes=num_bytes,
        num_tensors=len(pairs),
    )
    return payload, kept


@dataclass(kw_only=True)
class _EngineState:
    done: set[str] = field(default_factory=set)
    message: str = ""


def adapter_name(name: str, version: str) -> str:
    """The engine adapter name of version `version` (what rollouts pass as `lora_path` once it is committed)."""
    return f"{name}-v{version}"


async def run_lora_sync_session(
    *,
    engines: Sequence[EngineAPI],
    tp_sizes: Mapping[str, int],
    payload: Callable[[], Awaitable[AdapterPayload]],
    name: str,
    version: str,
    previous_version: str,
    pause_mode: PauseMode,
    timeouts: SessionTimeouts,
    previous: Mapping[str, str] | None = None,
    held: Collection[str] = (),
    verify: bool = True,
) -> SyncReport:
    """One LoRA sync of every engine (module docstring), loading the adapter as `adapter_name(name, version)`.
    `payload()` exports and encodes the adapter (after the pause). `previous`: URL -> the adapter name an engine
    serves now, unloaded once the new one is in and the sync committed; `held`: URLs kept paused since an earlier
    failure, resumed only by a sync that completes on them. `verify`: besides the engine's own expected_checksums
    check, read every engine's checksums of its base and draft weights (weights checker, selector all) after the
    pause and after the load; any difference fails the sync and leaves that engine paused (stale). Never raises
    for a failed sync: see the report. A failed load leaves every engine serving its previous adapter (the new
    name is unloaded wherever it did load)."""
    previous = {} if previous is None else dict(previous)
    new_name = adapter_name(name, version)
    states = {e.url: _EngineState() for e in engines}
    phases: dict[str, float] = {}
    sent: AdapterPayload | None = None
    error: str | None = None
    warnings: list[str] = []
    changed: list[str] = []
    start = time.perf_counter()
    t = timeouts.control_s

    async def step(what: str, call: Callable[[EngineAPI], Awaitable[object]], only=None) -> None:
        chosen = [e for e in engines if only is None or e.url in only]
        results = await asyncio.gather(*(asyncio.wait_for(call(e), t) for e in chosen), return_exceptions=True)
        failures = []
        for engine, result in zip(chosen, results):
            if isinstance(result, BaseException):
                message = str(result) or f"{type(result).__name__} (timed out after {t} s)"
                states[engine.url].message = states[engine.url].message or f"{what}: {message}"
                failures.append(f"{engine.url}: {message}")
            else:
                states[engine.url].done.add(what)
        if failures:
            raise RuntimeError(f"{what} failed on {len(failures)} of {len(chosen)} engine(s): " + "; ".join(failures))

    checksum = WeightsCheckerRequest(action=WeightsCheckerAction.CHECKSUM, selector=Selector.ALL)
    digests: dict[str, dict[str, str]] = {"base-before": {}, "base-after": {}}

    async def read_digests(what: str) -> None:
        async def read(engine: EngineAPI) -> None:
            result = await engine.weights_checker(checksum, timeout_s=t)
            digests[what][engine.url] = weights_digest(result.ranks, selector=Selector.ALL)

        with _timed(phases, "verify"):
            await step(what, read)

    async def run() -> None:
        nonlocal sent
        with _timed(phases, "pause"):
            await step("pause", lambda e: e.pause_generation(pause_mode, timeout_s=t))
            if pause_mode is not PauseMode.IN_PLACE:
                await step("flush", lambda e: e.flush_cache(timeout_s=t))
        if verify:
            await read_digests("base-before")
        with _timed(phases, "export"):
            sent = await payload()
        with _timed(phases, "send"):
            requests = {url: sent.request(name=new_name, tp_size=tp) for url, tp in tp_sizes.items()}
            await step("load", lambda e: e.load_lora_adapter_from_tensors(requests[e.url], timeout_s=t))
        with _timed(phases, "finalize"):
            await step("version", lambda e: e.update_weight_version(version, timeout_s=t))
        if verify:
            await read_digests("base-after")
            before, after = digests["base-before"], digests["base-after"]
            changed.extend(url for url in after if after[url] != before.get(url))
            for url in changed:
                states[url].message = "verify: its base or draft weights changed during a LoRA sync"
            if changed:
                raise RuntimeError(f"a LoRA sync changed the base or draft weights of {changed}")

    try:
        await asyncio.wait_for(run(), timeout=timeouts.sync_s)
    except Exception as exc:
        error = str(exc) or f"{type(exc).__name__}: the LoRA sync did not finish within {timeouts.sync_s} s"
    committed = error is None
    # Committed: the previous adapters go. Failed: the new one goes wherever it loaded; the previous one serves on.
    leaving = previous if committed else {s: new_name for s, state in states.items() if "load" in state.done}
    with _timed(phases, "finalize"):
        results = await asyncio.gather(
            *(
                asyncio.wait_for(
                    e.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=leaving[e.url]), timeout_s=t), t
                )
                for e in engines
                if e.url in leaving
            ),
            return_exceptions=True,
        )
        gone = [e.url for e in engines if e.url in leaving]
        warnings += [
            f"{url}: unloading {leaving[url]!r} failed: {r}"
            for url, r in zip(gone, results)
            if isinstance(r, BaseException)
        ]

    def is_stale(url: str) -> bool:
        # Its base or draft changed (it must not serve), or it was held and this sync did not complete on it.
        return url in changed or (url in held and not committed)

    with _timed(phases, "resume"):
        serving = {e.url for e in engines if not is_stale(e.url)}
        with contextlib.suppress(RuntimeError):
            await step("resume", lambda e: e.continue_generation(timeout_s=t), only=serving)
    engine_results = tuple(
        EngineResult(
            url=e.url,
            success=committed,
            is_stale=is_stale(e.url),
            num_verified_tensors=sent.num_tensors if sent is not None and "load" in states[e.url].done else 0,
            weight_version=version if "version" in states[e.url].done else None,
            message=states[e.url].message,
            verification=_verification(states[e.url].done, verify=verify) if committed else "",
        )
        for e in engines
    )
    return SyncReport(
        version=version,
        previous_version=previous_version,
        committed=committed,
        selector=None,
        transport=LORA_TRANSPORT,
        num_bytes=0 if sent is None else sent.num_bytes,
        num_buckets=0 if sent is None else 1,
        num_tensors=0 if sent is None else sent.num_tensors,
        phases=PhaseTimes(
            pause_s=phases.get("pause", 0.0),
            export_s=phases.get("export", 0.0),
            send_s=phases.get("send", 0.0),
            finalize_s=phases.get("finalize", 0.0),
            verify_s=phases.get("verify", 0.0),
            resume_s=phases.get("resume", 0.0),
        ),
        total_s=time.perf_counter() - start,
        engines=engine_results,
        error=error,
        checksums={} if sent is None else dict(sent.checksums),
        verification=_verification({"load", "base-after"}, verify=verify) if committed else "off",
        warnings=tuple(warnings),
    )


def _verification(done: set[str], *, verify: bool) -> str:
    """engine-checksums: the engine's own expected_checksums check passed; +base-unchanged: its base and draft
    checksums were the same before and after."""
    if "load" not in done:
        return ""
    return "engine-checksums+base-unchanged" if verify and "base-after" in done else "engine-checksums"


@contextlib.contextmanager
def _timed(phases: dict[str, float], name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
