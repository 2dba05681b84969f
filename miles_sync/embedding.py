"""The embedding API: a Miles/slime-style pipeline with its own Ray actors syncs weights through miles_sync.

Three steps, none of which needs miles_sync's launch code:

1. On every trainer rank, once its Megatron model exists (inside the pipeline's own trainer actor):

       from miles_sync.embedding import attach_model
       attach_model(model, hf_config=hf_config)          # the one call; `model` is this rank's model (chunks)

   torch.distributed and megatron-core model parallelism must already be initialized (the pipeline's own).
2. On the driver, with the trainer actors' handles (in rank order) and the URLs of running SGLang-compatible
   servers:

       from actors import create_controller
       controller = create_controller(trainers=trainer_actors, engine_urls=urls, sync=SyncConfig(...),
                                      model=ModelConfig(speculative_algorithm=..., num_trained_mtp_layers=0))
3. After each optimizer step (trainers idle, between steps):

       report = ray.get(controller.sync.remote(), timeout=...)   # SyncReport; raises SyncError if it failed

The controller reaches each rank's attached model through Ray's `__ray_call__` on the given actors, so the
pipeline's actor classes need no extra methods; a rank's export runs in its own process, on a thread of its own,
while the actor is otherwise idle (a sync actor runs it like any call; an async actor's event loop waits for it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

from miles_sync.config import ModelConfig, SyncConfig
from miles_sync.controller import GroupSettings, SyncController, SyncError
from miles_sync.env import read_environment
from miles_sync.protocol import Selector
from miles_sync.report import BucketProgress, SyncProgress, SyncReport
from miles_sync.selector import ConversionMode
from miles_sync.sender import SendResult, StageResult
from miles_sync.session import SelectorInputs, SessionTimeouts
from miles_sync.trainer import ModelSource, RankInfo, RankSendResult, SenderSettings
from miles_sync.transport.base import EngineEndpoint, FeedPlan, GroupMembership

__all__ = [
    "DEFAULT_ATTACHMENT",
    "ControllerService",
    "RemoteTrainerSource",
    "attach_model",
    "attached_source",
    "detach_model",
]

DEFAULT_ATTACHMENT = "default"

# Extra seconds the controller waits for a rank beyond the rank's own deadline, so the rank's precise error (not a
# bare controller-side timeout) is what gets reported.
_RANK_DEADLINE_MARGIN_S = 10.0
_PROGRESS_POLL_S = 0.2

_attached: dict[str, ModelSource] = {}
_attached_lock = threading.Lock()


def attach_model(
    model: Any,
    *,
    hf_config: Any,
    conversion: ConversionMode | str = ConversionMode.RAW,
    name: str = DEFAULT_ATTACHMENT,
    collective_timeout_s: float | None = None,
    feeds: FeedPlan | None = None,
) -> ModelSource:
    """Hand this rank's Megatron model to miles_sync; call it on every rank of the model, once.

    `model`: this rank's megatron-core GPTModel (or its list of virtual-pipeline chunks; DDP/Float16 wrappers are
    fine). `hf_config`: the transformers config of the checkpoint the engines serve (names and shapes of the HF
    tensors come from it). `conversion`: "raw" (miles_sync's converters) or "bridge" (megatron-bridge). `name`
    tells several attached models of one process apart. The model is read, never written; attaching again under
    the same name replaces the previous model. Returns the rank's ModelSource.

    `feeds` (the colocated transport only; the same plan on every rank): which trainer rank feeds each engine TP
    rank, from the devices they run on (`miles_sync.transport.base.plan_feeds`, or `placement.plan_colocated_feeds`
    for a miles_sync placement plan). Without it the export source alone hands every engine rank a handle to its
    own memory: fine on CPU and where all engine ranks share the source's GPU, refused by SGLang ("Invalid
    device_uuid") for an engine rank on another GPU.
    """
    if not name:
        raise ValueError("attach_model: name must be a non-empty string")
    timeout_s = read_environment().collective_timeout_s if collective_timeout_s is None else collective_timeout_s
    conversion = ConversionMode(conversion)
    source = ModelSource(
        model, hf_config=hf_config, conversion=conversion, collective_timeout_s=timeout_s, feeds=feeds
    )
    with _attached_lock:
        previous, _attached[name] = _attached.get(name), source
    if previous is not None:
        previous.shutdown()
    return source


def attached_source(name: str = DEFAULT_ATTACHMENT) -> ModelSource:
    """The ModelSource attached in this process under `name`; raises LookupError naming the attached ones."""
    with _attached_lock:
        source = _attached.get(name)
        names = sorted(_attached)
    if source is None:
        raise LookupError(
            f"no model attached under {name!r} in this process (attached: {names}); call "
            f"miles_sync.embedding.attach_model(model, hf_config=...) on every trainer rank first"
        )
    return source


def detach_model(name: str = DEFAULT_ATTACHMENT) -> None:
    """Drop the model attached under `name` and release its transport. Idempotent."""
    with _attached_lock:
        source = _attached.pop(name, None)
    if source is not None:
        source.shutdown()


def _on_rank(actor: object, name: str, method: str, kwargs: dict[str, Any]) -> Any:
    """Runs inside a trainer actor (through `__ray_call__`): one ModelSource call on the model attached there."""
    del actor  # the model is found by name, so any actor class works
    return getattr(attached_source(name), method)(**kwargs)


class RemoteTrainerSource:
    """The WeightSource (miles_sync.sender) over trainer actors whose processes attached a model.

    Async, for the controller actor's event loop. `connect()` first: it reads every rank's RankInfo and finds
    the export source (one pipeline stage: exactly one source rank). Every call has a deadline.
    """

    def __init__(
        self,
        *,
        trainers: Sequence[Any],
        settings: SenderSettings,
        attachment: str = DEFAULT_ATTACHMENT,
        control_timeout_s: float,
    ) -> None:
        if not trainers:
            raise ValueError("RemoteTrainerSource needs at least one trainer actor")
        if not control_timeout_s > 0:
            raise ValueError(f"control_timeout_s={control_timeout_s} must be positive")
        self._trainers = tuple(trainers)
        self._settings = settings
        self._attachment = attachment
        self._control_timeout_s = control_timeout_s
        self._ranks: tuple[RankInfo, ...] = ()
        self._source_index: int | None = None

    @property
    def ranks(self) -> tuple[RankInfo, ...]:
        return self._ranks

    async def connect(self) -> tuple[RankInfo, ...]:
        infos = await self._on_all("describe", timeout_s=self._control_timeout_s)
        sources = [i for i, info in enumerate(infos) if info.is_source]
        if len(sources) != 1:
            raise ValueError(
                f"trainer ranks {[infos[i].rank for i in sources]} are export sources; the update group has one "
                f"source rank, so the model must have exactly one pipeline stage (pp=1)"
            )
        self._ranks, self._source_index = tuple(infos), sources[0]
        return self._ranks

    async def exported_names(self) -> tuple[str, ...]:
        return await self._call(self._source(), "exported_names", timeout_s=self._control_timeout_s)

    async def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None
    ) -> GroupMembership | None:
        results = await self._on_all(
            "open",
            timeout_s=self._settings.call_timeout_s + _RANK_DEADLINE_MARGIN_S,
            engines=tuple(engines),
            membership=membership,
            settings=self._settings,
        )
        return results[self._source_index]

    async def send(
        self, *, selector: Selector, on_bucket: Callable[[BucketProgress], None] | None = None
    ) -> SendResult:
        # Every rank exports at once (the gather's collectives pair up); only the source's result carries bytes.
        sending = asyncio.ensure_future(
            self._on_all("send", timeout_s=self._settings.call_timeout_s + _RANK_DEADLINE_MARGIN_S, selector=selector)
        )
        num_seen = 0
        if on_bucket is not None:
            num_seen = await self._forward_progress(sending, on_bucket)
        results: list[RankSendResult] = await sending
        sent = results[self._source_index]
        if on_bucket is not None:
            for event in sent.progress[num_seen:]:  # acknowledged after the last poll
                on_bucket(event)
        return sent.result

    async def stage(self) -> StageResult:
        results = await self._on_all("stage", timeout_s=self._settings.call_timeout_s + _RANK_DEADLINE_MARGIN_S)
        return results[self._source_index]

    async def _forward_progress(self, sending: asyncio.Future, on_bucket: Callable[[BucketProgress], None]) -> int:
        """Poll the source rank for acknowledged buckets while `sending` runs and pass them on; returns how many.

        Best effort: buckets are acknowledged in the source's process, and an actor that runs one call at a time
        answers the poll only after the send (the rest then arrive with the send's result)."""
        num_seen = 0
        while not sending.done():
            await asyncio.wait({sending}, timeout=_PROGRESS_POLL_S)
            if sending.done():
                break
            try:
                events = await self._call(self._source(), "progress", timeout_s=self._control_timeout_s, start=num_seen)
            except Exception:  # progress must never fail a sync; the send's own outcome decides
                continue
            for event in events:
                on_bucket(event)
            num_seen += len(events)
        return num_seen

    async def close(self) -> None:
        await self._on_all("close", timeout_s=self._settings.call_timeout_s + _RANK_DEADLINE_MARGIN_S)

    def _source(self) -> Any:
        if self._source_index is None:
            raise RuntimeError("RemoteTrainerSource used before connect()")
        return self._trainers[self._source_index]

    async def _on_all(self, method: str, *, timeout_s: float, **kwargs: Any) -> list[Any]:
        """`method` on every rank concurrently; raises RuntimeError naming each failed rank after all answered."""
        results = await asyncio.gather(
            *(self._call(t, method, timeout_s=timeout_s, **kwargs) for t in self._trainers), return_exceptions=True
        )
        failures = [f"trainer {i}: {r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failures:
            shown = "; ".join(failures)
            raise RuntimeError(f"{method} failed on {len(failures)} of {len(results)} trainer rank(s): {shown}")
        return list(results)

    async def _call(self, trainer: Any, method: str, *, timeout_s: float, **kwargs: Any) -> Any:
        import ray

        ref = trainer.__ray_call__.remote(_on_rank, self._attachment, method, kwargs)
        try:
            return await asyncio.wait_for(ref, timeout=timeout_s)
        except asyncio.TimeoutError:
            ray.cancel(ref)
            raise TimeoutError(f"{method} got no answer within {timeout_s} s") from None
        except ray.exceptions.RayTaskError as exc:
            # The rank's own exception, without Ray's remote traceback around it.
            raise _cause(exc) from None


def _cause(exc: Exception) -> Exception:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc


class ControllerService:
    """What the controller actor runs: a SyncController over trainer actors and engine URLs. Async (one loop).

    `connect()` once, then `sync()` per training step. `backend`/`device`: "gloo"/"cpu", or "nccl"/"cuda" where
    the trainers' models live on GPUs (buckets are packed on the device and CUDA IPC handles travel).
    """

    def __init__(
        self,
        *,
        trainers: Sequence[Any],
        engine_urls: Sequence[str],
        sync: SyncConfig,
        model: ModelConfig,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        attachment: str = DEFAULT_ATTACHMENT,
        backend: str = "gloo",
        device: str = "cpu",
        master_address: str | None = None,
        show_progress: bool = False,
    ) -> None:
        settings = SenderSettings(
            transport=sync.transport.value,
            bucket_bytes=sync.bucket_bytes,
            bucket_timeout_s=sync.collective_timeout_s,
            open_timeout_s=sync.collective_timeout_s,
            http_timeout_s=sync.http_timeout_s,
            call_timeout_s=sync.sync_timeout_s,
            api_key=api_key,
            admin_api_key=admin_api_key,
            device=device,
            hash_buckets=sync.verify,
        )
        self._source = RemoteTrainerSource(
            trainers=trainers, settings=settings, attachment=attachment, control_timeout_s=sync.http_timeout_s
        )
        self._controller = SyncController(
            engine_urls=engine_urls,
            source=self._source,
            transport=sync.transport.value,
            selector_inputs=SelectorInputs(
                mode=sync.selector,
                speculative_algorithm=model.speculative_algorithm,
                num_trained_mtp_layers=model.num_trained_mtp_layers,
                conversion_mode=sync.conversion,
                check_coverage=sync.check_selector,
            ),
            pause_mode=sync.pause_mode,
            verify=sync.verify,
            staged=sync.staged,
            timeouts=SessionTimeouts(control_s=sync.http_timeout_s, sync_s=sync.sync_timeout_s),
            group=GroupSettings(
                backend=backend, master_address=read_environment().host if master_address is None else master_address
            ),
            api_key=api_key,
            admin_api_key=admin_api_key,
            show_progress=show_progress,
        )

    async def connect(self) -> tuple[RankInfo, ...]:
        """Find the trainers' source rank, then probe every engine (refusing one without the session endpoints)."""
        ranks = await self._source.connect()
        await self._controller.connect()
        return ranks

    async def sync(self, *, raise_on_failure: bool = True) -> SyncReport:
        """One sync to a new version. Raises SyncError (carrying the report) when it failed, unless
        `raise_on_failure` is False, in which case the failed report is returned."""
        try:
            return await self._controller.sync()
        except SyncError as exc:
            if raise_on_failure:
                raise
            return exc.report

    async def replace_engine(self, old_url: str, new_url: str) -> None:
        """A restarted engine's new URL; it is stale (not serving) until the next sync succeeds on it."""
        await self._controller.replace_engine(old_url, new_url)

    def version(self) -> int:
        return self._controller.version

    def weight_version(self) -> str:
        return self._controller.weight_version

    def engine_urls(self) -> tuple[str, ...]:
        return self._controller.engine_urls

    def serving_engines(self) -> tuple[str, ...]:
        return self._controller.serving_engines

    def stale_engines(self) -> tuple[str, ...]:
        return self._controller.stale_engines

    def held_engines(self) -> dict[str, str]:
        return self._controller.held_engines

    def progress(self) -> SyncProgress | None:
        """The running (or last) sync's acknowledged buckets; poll it from the driver while `sync` runs."""
        return self._controller.progress

    def membership(self) -> GroupMembership | None:
        return self._controller.membership

    def trainer_ranks(self) -> tuple[RankInfo, ...]:
        return self._source.ranks

    async def close(self) -> None:
        await self._controller.close()
