"""The controller actor: `miles_sync.embedding.ControllerService` wrapped with `ray.remote` here.

One per engine fleet. It owns the update group, the weight version and the sync lease, and runs each sync as one
session across all engines; it reaches the trainer ranks through the models they attached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from miles_sync.config import ModelConfig, SyncConfig
from miles_sync.embedding import DEFAULT_ATTACHMENT, ControllerService

__all__ = ["create_controller"]


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
