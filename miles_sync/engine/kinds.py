"""The engine-kind axis: `EngineKind` and its registry. Adding a kind touches its module and one row here.

Every kind speaks SGLang's HTTP contract, so one client (`miles_sync.engine.client.EngineClient`, an
`miles_sync.wire.api.EngineAPI`) serves all of them; a kind differs only in how its server is launched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from miles_sync.engine.command import LaunchCommand
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.settings import EngineSettings
from miles_sync.engine.sglang import SGLangEngineSpec
from miles_sync.wire.codec import WireEnum

__all__ = ["EngineKind", "EngineSpec", "engine_spec"]


class EngineKind(WireEnum):
    REFERENCE = "reference"  # the built-in CPU engine
    SGLANG = "sglang"


class EngineSpec(Protocol):
    """How to start one engine server; `command` may reserve a port, so call it right before the start."""

    def command(self, *, host: str) -> LaunchCommand: ...


ENGINE_KINDS: dict[EngineKind, Callable[[EngineSettings], EngineSpec]] = {
    EngineKind.REFERENCE: ReferenceEngineSpec.from_settings,
    EngineKind.SGLANG: SGLangEngineSpec.from_settings,
}


def engine_spec(kind: EngineKind | str, settings: EngineSettings) -> EngineSpec:
    """The launch spec of one engine of `kind` with `settings`. Pure."""
    return ENGINE_KINDS[EngineKind(kind)](settings)
