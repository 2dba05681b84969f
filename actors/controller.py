"""The controller actor: `ControllerService` (below) wrapped with `ray.remote` here.

One per engine fleet. It owns the update group, the weight version and the sync lease, and runs each sync as one
session across all engines; it reaches the trainer ranks through the models they attached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from actors.remote_source import RemoteTrainerSource
from miles_sync.config import ModelConfig, SyncConfig
from miles_sync.env import read_environment
from miles_sync.sync.attach import DEFAULT_ATTACHMENT
from miles_sync.sync.controller import GroupSettings, SyncController, SyncError
from miles_sync.sync.report import SyncProgress, SyncReport
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.sync.source import RankInfo, SenderSettings
from miles_sync.transport.base import GroupMembership

__all__ = ["ControllerService", "create_controller"]


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


def create_controller(
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
    show_progress: bool = False,
    options: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
) -> Any:
    """Start the controller actor and connect it to every trainer rank and engine; returns its handle.

    `trainers`: the trainer actors in rank order, each of whose processes called `attach_model`. Raises what
    `connect` raised (e.g. an engine without the session endpoints, named) after ending the actor.
    Then `ray.get(controller.sync.remote(), timeout=...)` runs one sync and returns its SyncReport.
    """
    # An async actor (one event loop for its engine clients); it computes nothing, so it needs no CPU of its own.
    remote_class = ray.remote(ControllerService)
    handle = remote_class.options(**({"num_cpus": 0} if options is None else options)).remote(
        trainers=list(trainers),
        engine_urls=list(engine_urls),
        sync=sync,
        model=model,
        api_key=api_key,
        admin_api_key=admin_api_key,
        attachment=attachment,
        backend=backend,
        device=device,
        show_progress=show_progress,
    )
    try:
        ray.get(handle.connect.remote(), timeout=timeout_s)
    except BaseException:
        ray.kill(handle)
        raise
    return handle
