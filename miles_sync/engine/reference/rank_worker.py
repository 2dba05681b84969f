"""One TP rank of a multi-rank reference engine: its own process, its slice of every runner, its own membership
in every weight-update group, its own weights checker. Driven by the engine's front (`ranks.py`) over pipes.

Three channels, each served by its own thread, so a long receive never blocks generation and a rendezvous never
blocks either:
- compute: forward steps of the target, the MTP head or the standalone draft. Their all-reduces and all-gathers
  run over the engine-internal gloo group (the default process group of this process), which no other channel
  touches.
- control: receive a broadcast bucket or decode this rank's colocated payload (staged), load the staged payload,
  discard it, finalize, reset the session, the weights checker, destroy a group; stage and load a direct payload
  (this rank's own engine-named tensors).
- group: join an update group at rank_offset + tp_rank (blocks for the rendezvous).

A request is a (op, kwargs) tuple; the answer is ("ok", value) or ("error", kind, message) with kind "value"
(a refusal), "timeout" or "fault". The process exits when its front closes the pipes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from miles_sync.engine.reference.backend import AllocationError, EngineCrashed, LocalBackend
from miles_sync.engine.reference.custom_loader import CustomLoaderFailed, run_custom_loader
from miles_sync.engine.reference.lora import AdapterSet, PreparedAdapter, build_adapter_set
from miles_sync.engine.reference.models import LMOutput
from miles_sync.engine.reference.sharded import ShardedRunner, load_sharded_runners
from miles_sync.engine.settings import LoraSettings
from miles_sync.weights.checksum import TensorHash
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.bucket import BucketEntry
from miles_sync.wire.dtypes import dtype_name
from miles_sync.wire.protocol import ChecksumNames, Role, WeightsCheckerRequest

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

CHANNELS = ("compute", "control", "group")
logger = logging.getLogger("miles_sync.engine.reference.rank")


@dataclass(frozen=True, kw_only=True)
class RankArgs:
    """What every rank process is started with (picklable)."""

    tp_rank: int
    tp_size: int
    store_host: str
    store_port: int
    model_path: str
    draft_kind: str
    draft_path: str | None
    weight_layout: WeightLayout
    draft_role: str
    collective_timeout_s: float
    num_threads: int | None
    lora: LoraSettings | None = None  # None: LoRA not enabled
    tensor_hash: TensorHash = TensorHash.SHA256  # how the checker's digests are computed (CPU or GPU SGLang hash)


class _Rank:
    """The state of one rank process; each method is one op of a channel."""

    def __init__(self, args: RankArgs, target: ShardedRunner, draft: ShardedRunner | None) -> None:
        self._args = args
        self._runners: dict[Role, ShardedRunner] = {Role.TARGET: target}
        if draft is not None:
            self._runners[Role.DRAFT] = draft
        self._backend = LocalBackend(
            self._runners,
            timeout_s=args.collective_timeout_s,
            checksum_names=ChecksumNames.ENGINE,
            draft_role=args.draft_role,
            tp_rank=args.tp_rank,
            tp_size=args.tp_size,
            tensor_hash=args.tensor_hash,
        )
        self._staged: list | None = None  # one payload at a time: the front serializes weight operations
        self._adapters: AdapterSet | None = None
        if args.lora is not None:
            self._adapters = build_adapter_set(target.model, args.lora, tp_rank=args.tp_rank, tp_size=args.tp_size)
        self._prepared: PreparedAdapter | None = None

    def metadata(self) -> dict[str, Any]:
        """The full HF metadata of every runner, for the front's validation (the same on every rank)."""
        return {
            role.value: {
                "is_mtp": runner.is_mtp,
                "tensors": {
                    name: (tuple(runner.expected(name).shape), dtype_name(runner.expected(name).dtype))
                    for name in sorted(runner.owned_names())
                },
            }
            for role, runner in self._runners.items()
        }

    # ---- compute ------------------------------------------------------------------------------------------------

    def forward(
        self, *, role: str, input_ids: torch.Tensor, lora_rows: list[str | None] | None = None
    ) -> LMOutput | None:
        runner = self._runners[Role(role)]
        serving = contextlib.nullcontext() if lora_rows is None else self._adapter_set().active(lora_rows)
        with runner.weights_lock, torch.inference_mode(), serving:
            out = runner.model(input_ids)
        return out if self._args.tp_rank == 0 else None

    # ---- adapters (two-phase: every rank prepares, then every rank installs or drops) ---------------------------

    def prepare_adapter(self, *, name: str, payload: Any, **fields: Any) -> int:
        self._prepared = None
        self._prepared = self._adapter_set().prepare(name, payload=payload, **fields)
        return self._prepared.num_bytes

    def drop_prepared_adapter(self) -> None:
        self._prepared = None

    def install_adapter(self) -> None:
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            raise ValueError("no prepared adapter to install")
        self._adapter_set().install(prepared)

    def remove_adapter(self, *, name: str) -> None:
        self._adapter_set().remove(name)

    def _adapter_set(self) -> AdapterSet:
        if self._adapters is None:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        return self._adapters

    def mtp(self, *, next_ids: torch.Tensor, hidden: torch.Tensor) -> LMOutput | None:
        target, head = self._runners[Role.TARGET], self._runners[Role.DRAFT]
        with target.weights_lock, torch.inference_mode():
            out = head.model(next_ids, hidden, embed_tokens=target.model.embed_tokens, lm_head=target.model.lm_head)
        return out if self._args.tp_rank == 0 else None

    # ---- control ------------------------------------------------------------------------------------------------

    def receive(self, *, group_name: str, entries: tuple[BucketEntry, ...], is_bucket: bool) -> None:
        self._staged = self._backend.receive(group_name, entries, is_bucket=is_bucket)

    def decode(self, *, payload: Any, load_format: str | None) -> list[tuple[str, tuple[int, ...], str]]:
        self._staged = None
        staged, metas = self._backend.decode([payload], load_format=load_format)
        self._staged = staged
        return [(m.name, tuple(m.shape), dtype_name(m.dtype)) for m in metas]

    def load(self, *, roles: list[str]) -> dict[str, list[str]]:
        staged, self._staged = self._staged, None
        if staged is None:
            raise ValueError("no staged payload to load")
        return {role: self._runners[Role(role)].load(staged) for role in roles}

    def received_bytes(self) -> int:
        (num_bytes,) = self._backend.received_bytes()
        return num_bytes

    def stage_direct(self, *, payload: Any, roles: list[str]) -> str | None:
        """Decode this rank's direct payload and check it against the `roles` runners; staged when it loads.
        Returns None, or why SGLang's loader would die on it (the front takes the whole engine down)."""
        self._staged = None
        try:
            self._staged = self._backend.stage_direct([self._runners[Role(r)] for r in roles], [payload])
        except EngineCrashed as exc:
            return str(exc)
        return None

    def load_direct(self, *, roles: list[str]) -> dict[str, list[str]]:
        staged, self._staged = self._staged, None
        if staged is None:
            raise ValueError("no staged direct payload to load")
        return {role: self._runners[Role(role)].load_direct(staged) for role in roles}

    def load_custom(self, *, payload: Any, path: str, roles: list[str]) -> dict[str, list[str]] | str:
        """Run the custom loader at `path` on this rank's payload into the `roles` runners (custom_loader); returns
        the engine names written per role, or why SGLang's scheduler would die (the front crashes the engine)."""
        self._staged = None
        named, _ = self._backend.decode([payload], load_format=None)
        try:
            return run_custom_loader(path, [self._runners[Role(r)] for r in roles], named)
        except CustomLoaderFailed as exc:
            return str(exc)

    def discard(self) -> None:
        self._staged = None

    def finalize(self, *, role: str, names: list[str] | None) -> None:
        runner = self._runners[Role(role)]
        if names is None:
            runner.finalize_all()
        else:
            runner.finalize(names)

    def reset_session(self, *, role: str) -> None:
        self._runners[Role(role)].reset_session()

    def check(self, *, request: WeightsCheckerRequest, roles: list[str]) -> Any:
        return self._backend.check(request, roles={Role(r) for r in roles})

    def destroy_group(self, *, group_name: str) -> None:
        self._backend.destroy_group(group_name)

    def close(self) -> None:
        self._backend.close()

    # ---- group --------------------------------------------------------------------------------------------------

    def join(self, **kwargs: Any) -> str:
        return self._backend.join_group(**kwargs)


def _serve(channel: str, conn: Connection, rank: _Rank) -> None:
    while True:
        try:
            op, kwargs = conn.recv()
        except (EOFError, OSError):  # the front is gone
            return
        try:
            reply = ("ok", getattr(rank, op)(**kwargs))
        except (ValueError, AllocationError) as exc:
            reply = ("error", "value", str(exc))
        except TimeoutError as exc:
            reply = ("error", "timeout", str(exc))
        except Exception as exc:  # an engine fault: reported to the front, the rank keeps serving
            logger.error("%s op %s failed:\n%s", channel, op, traceback.format_exc())
            reply = ("error", "fault", f"{type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


def rank_main(args: RankArgs, conns: dict[str, Connection]) -> None:
    """Entry point of a rank process: join the engine-internal group, load the shards, serve the channels."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{args.tp_rank} %(name)s %(levelname)s %(message)s")
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    control = conns["control"]
    try:
        timeout = timedelta(seconds=args.collective_timeout_s)
        store = dist.TCPStore(
            args.store_host, args.store_port, world_size=args.tp_size, is_master=False, timeout=timeout
        )
        dist.init_process_group("gloo", store=store, rank=args.tp_rank, world_size=args.tp_size, timeout=timeout)
        target, draft = load_sharded_runners(
            args.model_path,
            draft_kind=args.draft_kind,
            draft_path=args.draft_path,
            layout=args.weight_layout,
            tp_rank=args.tp_rank,
            tp_size=args.tp_size,
        )
        rank = _Rank(args, target, draft)
        control.send(("ok", rank.metadata()))
    except Exception as exc:
        control.send(("error", "value" if isinstance(exc, ValueError) else "fault", f"{type(exc).__name__}: {exc}"))
        return
    threads = [
        threading.Thread(target=_serve, args=(name, conns[name], rank), name=f"tp{args.tp_rank}-{name}", daemon=True)
        for name in ("compute", "group")
    ]
    for thread in threads:
        thread.start()
    try:
        _serve("control", control, rank)
    finally:
        rank.close()
