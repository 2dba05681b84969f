"""The front door: the names a user of miles_sync needs, in one import, without Ray.

    from miles_sync.api import SyncController, SyncConfig, attach_model, ...

Trainer side: `attach_model` (on every trainer rank, once its Megatron model exists). Driver side, without Ray: a
`SyncController` over a `WeightSource` (a `PipelineSource` of stage sources, or your own) and engine URLs, with
its `SelectorInputs`, `SessionTimeouts`, `GroupSettings` and optional `CanarySettings`; each sync returns a
`SyncReport` (per engine an `EngineResult`) or raises `SyncError`; `ControllerStatus` is its state at one moment.
Configs: `MilesSyncConfig` (the main job's, read by `load_config`), `SyncConfig` and `ModelConfig` (what
`actors.create_controller`, the Ray shell over the same controller, takes). The selector: `Selector` and
`weight_update_selector`. Engines: `EngineClient` (the HTTP contract) and `EngineLauncher` (start an SGLang or
reference server). With Ray, `actors.create_controller` builds the controller as an actor over trainer actors;
it lives in `actors/` because nothing in miles_sync imports Ray.
"""

from __future__ import annotations

from miles_sync.config import MilesSyncConfig, ModelConfig, SyncConfig, load_config
from miles_sync.engine.client import EngineClient
from miles_sync.engine.process import EngineLauncher
from miles_sync.sync.attach import attach_model
from miles_sync.sync.controller import ControllerStatus, SyncController
from miles_sync.sync.draft_canary import CanarySettings
from miles_sync.sync.pipeline import PipelineSource
from miles_sync.sync.report import EngineResult, SyncError, SyncReport
from miles_sync.sync.selector import weight_update_selector
from miles_sync.sync.session import SelectorInputs, SessionTimeouts
from miles_sync.sync.update_group import GroupSettings
from miles_sync.sync.weight_source import WeightSource
from miles_sync.wire.protocol import Selector

__all__ = [
    "CanarySettings",
    "ControllerStatus",
    "EngineClient",
    "EngineLauncher",
    "EngineResult",
    "GroupSettings",
    "MilesSyncConfig",
    "ModelConfig",
    "PipelineSource",
    "Selector",
    "SelectorInputs",
    "SessionTimeouts",
    "SyncConfig",
    "SyncController",
    "SyncError",
    "SyncReport",
    "WeightSource",
    "attach_model",
    "load_config",
    "weight_update_selector",
]
