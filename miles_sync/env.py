"""The one place that reads environment variables. Every variable has the MILES_SYNC_ prefix and a typed parser.

Addresses default to loopback: nothing in miles_sync binds a public interface unless the user asks for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

PREFIX = "MILES_SYNC_"
# The reference engine's API key travels to the server process in its environment, not on its command line: any
# local user can read a command line (/proc/PID/cmdline), only the owner can read an environment.
ENGINE_API_KEY_VARIABLE = PREFIX + "ENGINE_API_KEY"
ENGINE_ADMIN_API_KEY_VARIABLE = PREFIX + "ENGINE_ADMIN_API_KEY"  # the same, for the admin routes' key


def _read_str(name: str, default: str) -> str:
    value = os.environ.get(PREFIX + name)
    return default if value is None else value


def _read_float(name: str, default: float) -> float:
    value = os.environ.get(PREFIX + name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{PREFIX}{name}={value!r} is not a number") from None


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Process-wide settings taken from the environment at call time."""

    host: str
    http_timeout_s: float
    collective_timeout_s: float
    cache_dir: str  # generated reference checkpoints and other reusable artifacts
    engine_api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr
    engine_admin_api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr


def read_environment() -> Environment:
    return Environment(
        host=_read_str("HOST", "127.0.0.1"),
        http_timeout_s=_read_float("HTTP_TIMEOUT_S", 60.0),
        collective_timeout_s=_read_float("COLLECTIVE_TIMEOUT_S", 120.0),
        cache_dir=os.path.expanduser(_read_str("CACHE_DIR", "~/.cache/miles_sync")),
        engine_api_key=os.environ.get(ENGINE_API_KEY_VARIABLE),
        engine_admin_api_key=os.environ.get(ENGINE_ADMIN_API_KEY_VARIABLE),
    )
