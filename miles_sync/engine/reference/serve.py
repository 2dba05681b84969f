"""Run the CPU reference engine behind SGLang's HTTP contract.

    python -m miles_sync.engine.reference.serve --model DIR/target [--draft-kind mtp|standalone|ngram|none]
        [--draft DIR/draft] [--weight-layout none|aiter] [--finalize-policy strict|sglang] [--spec-steps K]
        [--checksum-names hf|engine] [--draft-role draft|draft_step_0] [--tp-size N]
        [--host 127.0.0.1] [--port P] [--api-key KEY] [--admin-api-key KEY] [--threads T]

Binds loopback unless told otherwise (default host from MILES_SYNC_HOST). `--port 0` lets the OS pick; once the
server accepts connections it prints exactly one line "listening on http://HOST:PORT" to stdout, so a parent
process can read the port. Logs go to stderr and never contain a key. SIGTERM or SIGINT stop it cleanly.
The keys are best passed as $MILES_SYNC_ENGINE_API_KEY and $MILES_SYNC_ENGINE_ADMIN_API_KEY (what EngineLauncher
does): `--api-key` and `--admin-api-key` show on the command line, which every local user can read. See server.py
for which routes need which key (SGLang's rules).

`--tp-size N` (N > 1) runs the engine as SGLang runs a TP engine: this process is the HTTP front and N rank
processes each hold their slice of every runner (attention heads, MLP intermediate and vocabulary split; see
miles_sync/weights/engine_layout.py), join every weight-update group at rank_offset + tp_rank, and answer the
weights checker per rank with engine names (the default, and the only choice, at N > 1). A dimension N does not
divide is refused at start-up, naming it. If a rank dies, the whole engine stops serving: /health answers 503
with the reason and every request is refused until the engine is restarted.

`--checksum-names engine` makes /weights_checker checksum answer what SGLang's checker answers (engine parameter
names, physical bytes, SGLang's digests) instead of HF names over logical bytes; `--draft-role draft_step_0` names
the draft runner as SGLang's multi-layer EAGLE does, in parallelism_info and as the checksum-name prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch
from aiohttp import web

from miles_sync.engine.reference.engine import ReferenceEngine
from miles_sync.engine.reference.lora import (
    LORA_TARGET_MODULES,
    LocalAdapters,
    RankAdapters,
    build_adapter_set,
)
from miles_sync.engine.reference.models import load_tokenizer, read_config
from miles_sync.engine.reference.ranks import RankBackend, RankRunnerView, start_rank_engine
from miles_sync.engine.reference.runner import DRAFT_KINDS, load_runners
from miles_sync.engine.reference.scheduler import Scheduler
from miles_sync.engine.reference.server import ServerSettings, create_app
from miles_sync.engine.settings import FinalizePolicy, LoraSettings
from miles_sync.env import ENGINE_ADMIN_API_KEY_VARIABLE, ENGINE_API_KEY_VARIABLE, Environment, read_environment
from miles_sync.weights.checksum import TensorHash
from miles_sync.weights.engine_layout import TPShape, tp_problems
from miles_sync.weights.fp8 import block_from_config
from miles_sync.weights.fp8_checkpoint import fp8_serving_problems
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.dtypes import config_dtype, dtype_name
from miles_sync.wire.protocol import ChecksumNames, Role
from miles_sync.wire.text import raise_if

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

# Draft role names this engine can report: SGLang's single draft runner, or step 0 of its multi-layer EAGLE.
DRAFT_ROLES = ("draft", "draft_step_0")

logger = logging.getLogger("miles_sync.engine.reference")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked: every bad value is named in one usage error (exit 2)."""
    env = read_environment()
    parser = argparse.ArgumentParser(
        prog="python -m miles_sync.engine.reference.serve", description=__doc__.split("\n")[0]
    )
    # The groups add their flags in --help's order.
    _add_model_arguments(parser)
    _add_checker_arguments(parser)
    _add_server_arguments(parser, env=env)
    _add_runtime_arguments(parser, env=env)
    _add_loader_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.checksum_names is None:
        args.checksum_names = (ChecksumNames.HF if args.tp_size == 1 else ChecksumNames.ENGINE).value
    problems = _argument_problems(args)
    if problems:
        parser.error("; ".join(problems))
    return args


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What the engine serves: the checkpoints, the draft, the weight layout and the finalize policy."""
    parser.add_argument("--model", required=True, help="target checkpoint directory (config.json + safetensors)")
    parser.add_argument("--draft-kind", choices=DRAFT_KINDS, default="none")
    parser.add_argument("--draft", default=None, help="standalone draft checkpoint directory")
    parser.add_argument("--draft-is-frozen", action="store_true", help="report the draft as never updated")
    parser.add_argument("--weight-layout", choices=[layout.value for layout in WeightLayout], default="none")
    parser.add_argument("--finalize-policy", choices=[p.value for p in FinalizePolicy], default="strict")
    parser.add_argument("--spec-steps", type=int, default=3)


def _add_checker_arguments(parser: argparse.ArgumentParser) -> None:
    """How the weights checker names and hashes, and the TP size and draft role that decide its names."""
    parser.add_argument(
        "--checksum-names",
        choices=[n.value for n in ChecksumNames],
        default=None,
        help="hf: HF names, logical bytes (the default at TP=1); engine: SGLang's checker (fused engine names, "
        "physical bytes; the default and only choice at TP > 1)",
    )
    parser.add_argument(
        "--tensor-hash",
        choices=[h.value for h in TensorHash],
        default=TensorHash.SHA256.value,
        help="how engine-named digests are computed: sha256 (SGLang's CPU tensor_hash) or gpu-hash (its CUDA "
        "Triton hash, computed here on the CPU, so a CPU test answers as a GPU server does); needs engine names",
    )
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks, one process each")
    parser.add_argument("--draft-role", choices=DRAFT_ROLES, default=DRAFT_ROLES[0])


def _add_server_arguments(parser: argparse.ArgumentParser, *, env: Environment) -> None:
    """Where the HTTP server listens, and its keys."""
    parser.add_argument("--host", default=env.host)
    parser.add_argument("--port", type=int, default=0, help="0: the OS picks a free port")
    parser.add_argument(
        "--api-key",
        default=env.engine_api_key,
        help=f"prefer ${ENGINE_API_KEY_VARIABLE}: a command line is readable by every local user",
    )
    parser.add_argument(
        "--admin-api-key",
        default=env.engine_admin_api_key,
        help=f"key of the admin routes; prefer ${ENGINE_ADMIN_API_KEY_VARIABLE}",
    )


def _add_runtime_arguments(parser: argparse.ArgumentParser, *, env: Environment) -> None:
    """Threads and waits."""
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--collective-timeout-s", type=float, default=env.collective_timeout_s)
    parser.add_argument("--generate-timeout-s", type=float, default=600.0)


def _add_loader_arguments(parser: argparse.ArgumentParser) -> None:
    """What a weight update may load besides the checkpoint's tensors: LoRA adapters and custom loaders."""
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters loaded from tensors")
    parser.add_argument("--max-lora-rank", type=int, default=64, help="the largest adapter rank accepted")
    parser.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=list(LORA_TARGET_MODULES),
        help="leaf names of the linear modules adapters may target",
    )
    parser.add_argument(
        "--custom-weight-loader",
        nargs="*",
        default=[],
        help="import paths a tensor update may name as its load_format (SGLang's flag of the same name)",
    )


def _argument_problems(args: argparse.Namespace) -> list[str]:
    """Every bad value or combination, by flag; `args.checksum_names` is already resolved from --tp-size."""
    problems = []
    if args.tp_size < 1:
        problems.append(f"--tp-size {args.tp_size} must be >= 1")
    if args.tp_size > 1 and args.checksum_names != ChecksumNames.ENGINE.value:
        problems.append(f"--checksum-names {args.checksum_names} needs --tp-size 1: TP ranks hold shards")
    if args.tensor_hash != TensorHash.SHA256.value and args.checksum_names != ChecksumNames.ENGINE.value:
        problems.append(f"--tensor-hash {args.tensor_hash} needs --checksum-names engine")
    if args.spec_steps < 1:
        problems.append(f"--spec-steps {args.spec_steps} must be >= 1")
    if not 0 <= args.port < 2**16:
        problems.append(f"--port {args.port} is not a TCP port")
    if args.threads is not None and args.threads < 1:
        problems.append(f"--threads {args.threads} must be >= 1")
    if args.enable_lora and args.max_lora_rank < 1:
        problems.append(f"--max-lora-rank {args.max_lora_rank} must be >= 1")
    if args.api_key is not None and not args.api_key:
        problems.append("--api-key is empty")
    if args.admin_api_key is not None and not args.admin_api_key:
        problems.append("--admin-api-key is empty")
    return problems


def build_engine(args: argparse.Namespace) -> ReferenceEngine:
    """Load the runners (finalized once, as at start-up), start the scheduler, wrap both in the engine."""
    _check_quantization(args)
    if args.tp_size > 1:
        return _build_rank_engine(args)
    layout = WeightLayout(args.weight_layout)
    target, draft = load_runners(args.model, draft_kind=args.draft_kind, draft_path=args.draft, layout=layout)
    settings = _lora_settings(args)
    adapters = None if settings is None else LocalAdapters(build_adapter_set(target.model, settings))
    return _engine(args, target, draft, adapters=adapters)


def _lora_settings(args: argparse.Namespace) -> LoraSettings | None:
    if not args.enable_lora:
        return None
    return LoraSettings(max_rank=args.max_lora_rank, target_modules=tuple(args.lora_target_modules))


def _engine(
    args: argparse.Namespace, target, draft, *, backend: RankBackend | None = None, adapters: Any = None
) -> ReferenceEngine:
    """The scheduler over `target`/`draft` (runners, or a multi-rank engine's views of them) and the engine."""
    scheduler = Scheduler(
        target=target,
        draft=draft,
        draft_kind=args.draft_kind,
        spec_steps=args.spec_steps,
        tokenizer=load_tokenizer(args.model),
        adapters=adapters,
    )
    return ReferenceEngine(
        target=target,
        draft=draft,
        draft_kind=DraftKind(args.draft_kind),
        scheduler=scheduler,
        model_path=str(args.model),
        finalize_policy=FinalizePolicy(args.finalize_policy),
        collective_timeout_s=args.collective_timeout_s,
        draft_is_frozen=args.draft_is_frozen,
        checksum_names=ChecksumNames(args.checksum_names),
        tensor_hash=TensorHash(args.tensor_hash),
        draft_role=args.draft_role,
        backend=backend,
        adapters=adapters,
        custom_weight_loaders=tuple(args.custom_weight_loader),
    )


def _build_rank_engine(args: argparse.Namespace) -> ReferenceEngine:
    """Start the TP rank processes (each loads and shards the checkpoint), then the front's scheduler and engine."""
    config = read_config(args.model)
    draft_config = config if args.draft is None else read_config(args.draft)  # a standalone draft's own
    checked = [("the target", args.model, config)] + ([("the draft", args.draft, draft_config)] if args.draft else [])
    problems = [
        f"{what} ({path}, model_type {model_config.model_type}): {problem}"
        for what, path, model_config in checked
        for problem in tp_problems(TPShape.from_config(model_config), args.tp_size)
    ]
    if problems:  # before spawning anything: what SGLang refuses at start-up
        raise ValueError(f"cannot run at --tp-size {args.tp_size}: " + "; ".join(problems))
    fleet, metadata = start_rank_engine(
        tp_size=args.tp_size,
        host=args.host,
        model_path=str(args.model),
        draft_kind=args.draft_kind,
        draft_path=args.draft,
        weight_layout=WeightLayout(args.weight_layout),
        draft_role=args.draft_role,
        collective_timeout_s=args.collective_timeout_s,
        num_threads=args.threads,
        lora=_lora_settings(args),
        tensor_hash=TensorHash(args.tensor_hash),
    )
    try:
        lock = threading.RLock()  # the front's weights lock: forward steps and weight writes, across all ranks
        target = RankRunnerView(fleet, role=Role.TARGET, config=config, metadata=metadata["target"], weights_lock=lock)
        draft = None
        if Role.DRAFT.value in metadata:
            draft = RankRunnerView(
                fleet, role=Role.DRAFT, config=draft_config, metadata=metadata["draft"], weights_lock=lock
            )
        adapters = None if not args.enable_lora else RankAdapters(fleet)
        return _engine(
            args,
            target,
            draft,
            backend=RankBackend(fleet, weights_lock=lock, tensor_hash=TensorHash(args.tensor_hash)),
            adapters=adapters,
        )
    except BaseException:
        fleet.close()
        raise


def _check_quantization(args: argparse.Namespace) -> None:
    """A block-FP8 checkpoint: SGLang's block/partition size check at --tp-size, before anything loads."""
    config = read_config(args.model).to_dict()
    if block_from_config(config) is None:
        return
    problems = fp8_serving_problems(config, tp_size=args.tp_size)
    if args.tp_size > 1:
        problems.append(f"the reference engine serves block FP8 at --tp-size 1 only, not {args.tp_size}")
    raise_if(problems, what=f"cannot serve the block-FP8 checkpoint {args.model}")


async def _serve(args: argparse.Namespace, engine: ReferenceEngine) -> None:
    config = read_config(args.model)
    block = block_from_config(config)
    settings = ServerSettings(
        model_path=str(args.model),
        draft_kind=args.draft_kind,
        weight_layout=args.weight_layout,
        spec_steps=args.spec_steps,
        generate_timeout_s=args.generate_timeout_s,
        quantization=None if block is None else "fp8",
        weight_block_size=None if block is None else block.block,
        dtype=dtype_name(config_dtype(config)),
    )
    app = create_app(
        engine, settings=settings, api_key=args.api_key, admin_api_key=args.admin_api_key, on_crash=_exit_on_crash
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        site = web.SockSite(runner, sock)
        await site.start()
        host, port = sock.getsockname()[:2]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        url = f"http://[{host}]:{port}" if family == socket.AF_INET6 else f"http://{host}:{port}"
        logger.info(
            "serving %s at TP=%d (draft %s as %r, layout %s, finalize policy %s, checksum names %s, api key %s, "
            "admin api key %s)",
            args.model,
            args.tp_size,
            args.draft_kind,
            args.draft_role,
            args.weight_layout,
            args.finalize_policy,
            args.checksum_names,
            _is_set(args.api_key),
            _is_set(args.admin_api_key),
        )
        print(f"listening on {url}", flush=True)
        watcher = asyncio.create_task(_stop_when_orphaned(stop, parent=os.getppid()))
        try:
            await stop.wait()
        finally:
            watcher.cancel()
    finally:
        await runner.cleanup()
        sock.close()


async def _stop_when_orphaned(stop: asyncio.Event, *, parent: int) -> None:
    """Stop serving once the process that started this server is gone (this process was re-parented): a launcher
    killed without its clean-up (a crashed Ray node, a SIGKILLed driver) must not leave an engine holding memory
    and a port for ever. Its own `stop` sends SIGTERM first, so a live launcher never reaches this."""
    while os.getppid() == parent:
        await asyncio.sleep(_ORPHAN_POLL_S)
    logger.warning("the launching process %d is gone: shutting down", parent)
    stop.set()


_ORPHAN_POLL_S = 1.0
_CRASH_EXIT_CODE = 70


def _exit_on_crash(message: str) -> None:
    """What SGLang 0.5.23's server does when its scheduler raises (a direct load naming an unknown parameter or a
    wrong shape, measured): SIGQUIT to the server, which kills its process tree, so the request in flight gets no
    answer and /health_generate refuses connections. Exit at once; the rank processes exit when their pipes close."""
    logger.critical("Scheduler hit an exception: %s; exiting without answering, as SGLang's server does", message)
    logging.shutdown()
    os._exit(_CRASH_EXIT_CODE)


def _is_set(key: str | None) -> str:
    return "set" if key is not None else "not set"  # never the key itself


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        engine = build_engine(args)
    except ValueError as exc:  # a refusal at start-up (a TP size a dimension does not divide, a bad checkpoint)
        logger.error("cannot start: %s", exc)
        return 2
    try:
        asyncio.run(_serve(args, engine))
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
