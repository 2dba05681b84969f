"""Thin Ray shells over miles_sync's plain classes: trainer ranks, rollout engines and the sync controller.

Each module applies `ray.remote(...)` to its class when it creates the actors (nothing here is decorated at import
time), so every class stays usable and testable without Ray.
"""

from actors.controller import create_controller
from actors.rollout import EngineGroup, create_engines
from actors.trainer import TrainerGroup, create_trainers

__all__ = ["EngineGroup", "TrainerGroup", "create_controller", "create_engines", "create_trainers"]
