"""Run the SGLang router (sglang-router 0.3.2's Rust router) from its Python binding, without its launcher module.

    python -m miles_sync.engine.router_launch --host 127.0.0.1 --port 30100 --policy round_robin ...

Runs in the real SGLang server's venv (launch/install_sglang.sh installs sglang-router there). The package's own
entry points (`python -m sglang_router.launch_router`, `smg launch`) import `sglang_router.mini_lb`, which imports
`sglang` itself: minutes of imports on a cold node, and on this CPU machine an import error without the CPU shims.
The router is the Rust `Router` either way; this entry point parses the same flags with the package's `RouterArgs`
and starts that Router, importing nothing else. Miles starts the same router (`sglang_router`'s RouterArgs and
launch_router in its rollout router manager), which is why miles_sync uses sglang-router rather than its
successor package `smg`. Imports nothing heavy.
"""

from __future__ import annotations

import argparse
import sys

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine


def main(argv: list[str] | None = None) -> None:
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="miles_sync.engine.router_launch")
    RouterArgs.add_cli_args(parser)
    args = RouterArgs.from_cli_args(parser.parse_args(sys.argv[1:] if argv is None else argv))
    args._validate_router_args()
    print(f"listening on http://{args.host}:{args.port}", flush=True)  # the launcher reads the URL from here
    Router.from_args(args).start()  # blocks until the process is stopped


if __name__ == "__main__":
    main()
