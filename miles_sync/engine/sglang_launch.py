"""Run `python -m sglang.launch_server` with its keys taken from the environment, not the command line.

    python -m miles_sync.engine.sglang_launch --model-path ... --port ...    # SGLang's own flags, as they are

SGLang 0.5.23 reads `--api-key` / `--admin-api-key` from its command line or a `--config` YAML file, never from
an environment variable, and any local user can read a command line (/proc/PID/cmdline). So the launcher puts the
keys in MILES_SYNC_ENGINE_API_KEY / MILES_SYNC_ENGINE_ADMIN_API_KEY (readable by the owner only), and this entry
point moves them onto SGLang's argument list inside the process: `sys.argv` is the interpreter's copy, the kernel's
command line of the process stays as it was started. The variables are removed before SGLang starts, so its worker
processes do not inherit them. Imports nothing heavy: it runs before SGLang in the server's own process.
"""

from __future__ import annotations

import os
import runpy
import sys

from miles_sync.env import ENGINE_ADMIN_API_KEY_VARIABLE, ENGINE_API_KEY_VARIABLE

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

SGLANG_MODULE = "sglang.launch_server"
KEY_FLAGS = {ENGINE_API_KEY_VARIABLE: "--api-key", ENGINE_ADMIN_API_KEY_VARIABLE: "--admin-api-key"}


def server_argv(args: list[str], environ: dict[str, str] | os._Environ) -> list[str]:
    """SGLang's arguments: `args` plus one flag per key variable set in `environ`, which loses those variables
    (mutates `environ`). A key given on the command line as well is refused (ValueError), never silently doubled."""
    given = sorted(flag for flag in KEY_FLAGS.values() if any(a == flag or a.startswith(flag + "=") for a in args))
    if given:
        raise ValueError(f"{', '.join(given)} on the command line: pass keys in {', '.join(KEY_FLAGS)} instead")
    keys = [(flag, environ.pop(variable, None)) for variable, flag in KEY_FLAGS.items()]
    return [*args, *(token for flag, key in keys if key is not None for token in (flag, key))]


def main() -> None:
    sys.argv = [sys.argv[0], *server_argv(sys.argv[1:], os.environ)]
    runpy.run_module(SGLANG_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
