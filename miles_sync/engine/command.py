"""How an engine server process is started: its argv, environment and (when known in advance) its URL."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine


@dataclass(frozen=True, kw_only=True)
class LaunchCommand:
    """One server start: the argv and the URL if it is known in advance (None: read it from the server's stdout)."""

    argv: tuple[str, ...]
    url: str | None
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # added to the server's environment; secrets
    # GET path answering 200 once the server serves: an engine's generates one real token; a router's only answers.
    ready_path: str = "/health_generate"


def reserve_port(host: str) -> int:
    """A port the OS reports free on `host` right now. Released before returning: for servers (SGLang) that only
    take a port number; another process could take it in between, which the health wait then reports."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
