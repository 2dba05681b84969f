"""The `sglang` engine kind: an SGLang server (`python -m sglang.launch_server`) on a GPU node.

SGLang needs a port up front, so the spec asks the OS for a free one right before the start.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from miles_sync.engine.command import LaunchCommand, reserve_port, url_host
from miles_sync.engine.settings import EngineSettings

__all__ = ["SGLangEngineSpec"]


@dataclass(frozen=True, kw_only=True)
class SGLangEngineSpec:
    """An SGLang server (GPU nodes). `extra_args` go to `sglang.launch_server` as they are."""

    model_path: str
    tp_size: int = 1
    extra_args: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or a report
    admin_api_key: str | None = field(default=None, repr=False)  # SGLang's --admin-api-key; a secret as well

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> SGLangEngineSpec:
        return cls(
            model_path=settings.model_dir,
            tp_size=settings.tp_size,
            api_key=settings.api_key,
            admin_api_key=settings.admin_api_key,
        )

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"invalid SGLangEngineSpec: tp_size={self.tp_size} must be at least 1")

    def command(self, *, host: str) -> LaunchCommand:
        port = reserve_port(host)
        argv = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            host,
            "--port",
            str(port),
            "--tp-size",
            str(self.tp_size),
            *self.extra_args,
        ]
        if self.api_key is not None:  # SGLang reads its keys from the command line only
            argv += ["--api-key", self.api_key]
        if self.admin_api_key is not None:
            argv += ["--admin-api-key", self.admin_api_key]
        return LaunchCommand(argv=tuple(argv), url=f"http://{url_host(host)}:{port}")
