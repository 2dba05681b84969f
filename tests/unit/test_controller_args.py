"""The controller's arguments derived from the job's config (actors.controller.controller_args): pure, no Ray
cluster needed."""

from __future__ import annotations

import pytest

from actors.controller import controller_args
from miles_sync.config import ModelConfig, SyncConfig
from miles_sync.sync.controller import SyncController
from miles_sync.wire.protocol import PauseMode


@pytest.mark.parametrize(
    ("pause_mode", "flushes"), [(PauseMode.ABORT, True), (PauseMode.RETRACT, True), (PauseMode.IN_PLACE, False)]
)
def test_updates_flush_the_prefix_cache_where_the_pause_empties_the_engines(pause_mode, flushes):
    # abort and retract leave no request running, so each update flushes as it loads and the session sends no
    # /flush_cache (a gc pass on a CPU SGLang server); in_place keeps requests running: SGLang refuses that flush.
    kwargs = controller_args(
        trainers=[object()],
        engine_urls=["http://127.0.0.1:1"],
        sync=SyncConfig(pause_mode=pause_mode),
        model=ModelConfig(),
    )
    assert kwargs["pause_mode"] is pause_mode
    assert kwargs["source"].flushes_cache is flushes
    SyncController(**kwargs)  # a consistent pair: the controller accepts it
