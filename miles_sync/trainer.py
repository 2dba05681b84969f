"""The trainer side: one Megatron rank that trains (`TrainerWorker`) and its share of every sync (`ModelSource`).

`ModelSource` is what a sync needs from one rank: the export of its Megatron model (every rank runs the gather's
collectives; the stage's source rank receives the full HF tensors) and, on the source rank, the sender that packs
and ships them. Given a colocated feed plan (`feeds`), every rank of the plan also takes part in each colocated
bucket: it hands its own copy to the engine ranks on its device. It owns a private event loop thread, so its
blocking methods work the same from a plain Ray actor, an async actor (through `__ray_call__`) or a script.
Pipelines with their own trainer actors create one through `miles_sync.embedding.attach_model`; `TrainerWorker`
does the same for the model it builds.

`TrainerWorker` is the trainer the launch code runs (one Ray actor per rank): its own gloo group on loopback,
megatron-core model parallelism, the model built from the HF config the engines serve and loaded from the same
checkpoint (so both copies start bit-identical), and a real optimizer: a REINFORCE step with Adam on given token
sequences and rewards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch

from miles_sync.config import TrainerConfig
from miles_sync.export.units import ExportedUnit
from miles_sync.plan import AtomicUnit
from miles_sync.protocol import Selector
from miles_sync.report import BucketProgress
from miles_sync.selector import ConversionMode
from miles_sync.sender import SendResult, Sender, StageResult
from miles_sync.transport.base import EngineEndpoint, FeedPlan, FeedRole, GroupMembership, transport_spec
from miles_sync.transport.colocated import PostedPayload, find_source_rank

__all__ = [
    "ModelSource", "RankInfo", "RankSendResult", "SenderSettings", "TrainBatch", "TrainStepResult", "TrainerWorker",
]  # fmt: skip

T = TypeVar("T")
_LOOP_STOP_S = 5.0


@dataclass(frozen=True, kw_only=True)
class SenderSettings:
    """How the source rank sends, chosen by the controller per update group (so one trainer can serve several).

    `call_timeout_s` bounds one whole open or send call on a rank; the bucket and HTTP timeouts bound each step.
    """

    transport: str
    bucket_bytes: int
    bucket_timeout_s: float
    open_timeout_s: float
    http_timeout_s: float
    call_timeout_s: float
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or a report
    admin_api_key: str | None = field(default=None, repr=False)  # the engines' admin key, where they have one
    device: str = "cpu"
    hash_buckets: bool = True  # checksums of what was sent: verification needs them (see Sender)

    def __post_init__(self) -> None:
        names = ("bucket_bytes", "bucket_timeout_s", "open_timeout_s", "http_timeout_s", "call_timeout_s")
        problems = [f"{name}={getattr(self, name)} must be positive" for name in names if not getattr(self, name) > 0]
        if problems:
            raise ValueError("invalid SenderSettings: " + "; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """One trainer rank as the controller sees it."""

    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    is_source: bool  # receives the full HF tensors and sends them
    num_exported_tensors: int


@dataclass(frozen=True, kw_only=True)
class RankSendResult:
    """One rank's part of a send. `progress`: the source's per-bucket events, in order (empty elsewhere)."""

    rank: int
    result: SendResult
    progress: tuple[BucketProgress, ...]


class _LoopThread:
    """An asyncio loop on a daemon thread; `run` submits a coroutine and waits for it with a timeout."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], *, timeout_s: float, what: str) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise  # the coroutine's own TimeoutError, with its own message
            future.cancel()
            raise TimeoutError(f"{what} did not finish within {timeout_s} s") from None

    def stop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_LOOP_STOP_S)
        if not self._thread.is_alive():
            self._loop.close()


class ModelSource:
    """One rank's Megatron model as a weight source. Blocking methods; call them from one thread at a time.

    Needs torch.distributed and megatron-core model parallelism initialized (the pipeline's own). Every rank of
    the model must `send` at the same time (the export's collectives pair up across ranks); `open` and `close`
    only do work on the source rank. The model must not be trained while a send runs.
    """

    def __init__(
        self,
        model: Any,
        *,
        hf_config: Any,
        conversion: ConversionMode = ConversionMode.RAW,
        collective_timeout_s: float,
        feeds: FeedPlan | None = None,
    ) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from miles_sync.export.megatron import is_export_source

        if not collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s={collective_timeout_s} must be positive")
        if feeds is not None and feeds.num_trainers != dist.get_world_size():
            raise ValueError(
                f"the colocated feed plan covers {feeds.num_trainers} trainer ranks, the trainer group has "
                f"{dist.get_world_size()}"
            )
        self._feeds = feeds
        self._export_units, metadata = _exporter(
            model, hf_config=hf_config, conversion=ConversionMode(conversion), timeout_s=collective_timeout_s
        )
        self._is_source = is_export_source()
        self._names = tuple(t.name for unit in metadata for t in unit.tensors)
        rank = dist.get_rank()
        self._info = RankInfo(
            rank=rank,
            world_size=dist.get_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            is_source=self._is_source,
            num_exported_tensors=len(self._names),
        )
        self._loop = _LoopThread(name=f"miles-sync-source-{rank}")
        self._sender: Sender | None = None
        self._call_timeout_s = collective_timeout_s
        self._unit_listeners: list[Callable[[int], None]] = []
        # The current (or last) send's acknowledged buckets, appended on the loop thread as they happen: `progress`
        # reads them from another thread while the send runs (list appends and slices are atomic in CPython).
        self._progress: list[BucketProgress] = []

    def describe(self) -> RankInfo:
        return self._info

    def exported_names(self) -> tuple[str, ...]:
        """The HF names one send covers on this stage (metadata only; no collective)."""
        return self._names

    def add_unit_listener(self, listener: Callable[[int], None]) -> None:
        """Call `listener(i)` on the export thread as the i-th unit of a send leaves the export (progress, or fault
        drills that act at a precise point of a sync). A listener that raises fails that send."""
        self._unit_listeners.append(listener)

    def clear_unit_listeners(self) -> None:
        self._unit_listeners.clear()

    def open(
        self, *, engines: Sequence[EngineEndpoint], membership: GroupMembership | None, settings: SenderSettings
    ) -> GroupMembership | None:
        """(Re)build the sender for `engines`; on the source rank this joins the update group while the engines do.
        Returns the membership bound to its port (non-source ranks return `membership` as given)."""
        self.close(timeout_s=settings.call_timeout_s)
        role = None
        if self._feeds is not None and transport_spec(settings.transport).feeds_from_every_rank:
            # Every rank opens at once, before any send: the one moment a collective on the default group cannot
            # interleave with the export's.
            source_rank = find_source_rank(is_source=self._is_source)
            role = FeedRole(plan=self._feeds, rank=self._info.rank, source_rank=source_rank)
        sender = Sender(
            transport=settings.transport if self._is_source else None,
            export=self._export,
            names=self.exported_names,
            bucket_bytes=settings.bucket_bytes,
            bucket_timeout_s=settings.bucket_timeout_s,
            open_timeout_s=settings.open_timeout_s,
            http_timeout_s=settings.http_timeout_s,
            api_key=settings.api_key,
            admin_api_key=settings.admin_api_key,
            device=settings.device,
            hash_buckets=settings.hash_buckets,
            feeds=role,
        )
        bound = self._loop.run(
            sender.open(engines=engines, membership=membership),
            timeout_s=settings.call_timeout_s,
            what=f"rank {self._info.rank} opening the {settings.transport} transport",
        )
        self._sender = sender
        self._call_timeout_s = settings.call_timeout_s
        return bound

    def send(self, *, selector: Selector) -> RankSendResult:
        """Export and (on the source rank) send the current weights once. Raises on any failure; the transport must
        then be re-opened (the controller does it at the next sync)."""
        sender = self._sender
        if sender is None:
            raise RuntimeError(f"rank {self._info.rank}: send before open()")
        self._progress = progress = []
        result = self._loop.run(
            sender.send(selector=selector, on_bucket=progress.append),
            timeout_s=self._call_timeout_s,
            what=f"rank {self._info.rank} sending weights",
        )
        return RankSendResult(rank=self._info.rank, result=result, progress=tuple(progress))

    def posted_payloads(self) -> tuple[PostedPayload, ...]:
        """What this rank posted to engines in the last colocated send: each engine rank's feeder and the pid that
        created the shared segment its handle names (empty on ranks that post nothing)."""
        return () if self._sender is None else self._sender.posted_payloads()

    def stage(self) -> StageResult:
        """Export and pack the current weights ahead of the next send (every rank at once, as for `send`)."""
        sender = self._sender
        if sender is None:
            raise RuntimeError(f"rank {self._info.rank}: stage before open()")
        return self._loop.run(sender.stage(), timeout_s=self._call_timeout_s, what=f"rank {self._info.rank} staging")

    def progress(self, *, start: int = 0) -> tuple[BucketProgress, ...]:
        """The buckets the current (or last) send had acknowledged, from the `start`-th on; safe to call while a
        send runs on another thread (the actor needs max_concurrency > 1 for that)."""
        return tuple(self._progress[start:])

    def close(self, *, timeout_s: float = 60.0) -> None:
        """Tear the transport down (idempotent)."""
        sender, self._sender = self._sender, None
        if sender is not None:
            self._loop.run(sender.close(), timeout_s=timeout_s, what=f"rank {self._info.rank} closing the transport")

    def shutdown(self) -> None:
        try:
            self.close()
        finally:
            self._loop.stop()

    def _export(self) -> Iterator[ExportedUnit]:
        units = self._export_units()
        for index, unit in enumerate(units):
            try:
                for listener in tuple(self._unit_listeners):
                    listener(index)
            except Exception:
                # The other ranks are inside the same export's collectives: finish them before failing, or every
                # peer would block until its collective timeout and the next sync with it.
                for _ in units:
                    pass
                raise
            yield unit


def _exporter(
    model: Any, *, hf_config: Any, conversion: ConversionMode, timeout_s: float
) -> tuple[Callable[[], Iterable[ExportedUnit]], list[AtomicUnit]]:
    """The export stream factory and its unit metadata for `conversion`, chosen once per model."""
    if conversion is ConversionMode.BRIDGE:
        from miles_sync.export.bridge import BridgeExporter, bridge_for_config

        exporter = BridgeExporter(bridge_for_config(hf_config), model)
        return exporter.iter_units, exporter.metadata()
    from miles_sync.export.megatron import export_metadata, iter_hf_units
    from miles_sync.export.raw import create_converter

    converter = create_converter(hf_config.model_type, hf_config)

    def units() -> Iterator[ExportedUnit]:
        return iter_hf_units(model, converter=converter, source_rank_only=True, timeout_s=timeout_s)

    return units, export_metadata(model, converter=converter)


@dataclass(frozen=True, kw_only=True)
class TrainBatch:
    """Token sequences (prompt + completion) and one reward each. The loss covers completion tokens only.

    `baseline`: subtracted from every reward (the advantage); None uses the batch's mean reward.
    """

    sequences: tuple[tuple[int, ...], ...]
    num_prompt_tokens: tuple[int, ...]
    rewards: tuple[float, ...]
    baseline: float | None = None

    def __post_init__(self) -> None:
        problems = [] if self.sequences else ["sequences is empty"]
        if not len(self.sequences) == len(self.num_prompt_tokens) == len(self.rewards):
            problems.append(
                f"{len(self.sequences)} sequences, {len(self.num_prompt_tokens)} prompt lengths and "
                f"{len(self.rewards)} rewards must be as many"
            )
        bad = [i for i, (s, n) in enumerate(zip(self.sequences, self.num_prompt_tokens)) if not 1 <= n < len(s)]
        if bad:
            problems.append(f"sequences {bad} need 1 <= num_prompt_tokens < length (at least one completion token)")
        if problems:
            raise ValueError("invalid TrainBatch: " + "; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class TrainStepResult:
    step: int  # optimizer steps taken so far, this one included
    loss: float  # the policy-gradient loss of this step
    mean_token_nll: float  # mean negative log-likelihood of the completion tokens, before the step
    num_tokens: int
    seconds: float


class TrainerWorker:
    """One Megatron rank (PP=1, EP=1): process group, model, checkpoint, optimizer, and its ModelSource.

    Lifecycle: construct on every rank (cheap), `host_store()` on rank 0, `setup(master_port=...)` on every rank at
    the same time, then `train_step` on every rank with the same batch, and syncs through `source`. `feeds`: the
    colocated feed plan of the placement (see ModelSource), None to feed every engine rank from the source.
    """

    def __init__(
        self,
        *,
        rank: int,
        trainer: TrainerConfig,
        checkpoint_dir: str,
        num_trained_mtp_layers: int = 0,
        seed: int = 0,
        num_threads: int | None = 1,
        timeout_s: float = 120.0,
        attachment: str = "default",
        backend: str | None = None,
        feeds: FeedPlan | None = None,
    ) -> None:
        problems = []
        if not 0 <= rank < trainer.world_size:
            problems.append(f"rank={rank} is outside [0, {trainer.world_size}) (tp*pp*dp)")
        if trainer.pp != 1 or trainer.ep != 1:
            problems.append(f"pp={trainer.pp}, ep={trainer.ep}: TrainerWorker trains with pp=1 and ep=1 only")
        if num_trained_mtp_layers < 0:
            problems.append(f"num_trained_mtp_layers={num_trained_mtp_layers} must be non-negative")
        if num_threads is not None and num_threads < 1:
            problems.append(f"num_threads={num_threads} must be at least 1 (or None)")
        if not timeout_s > 0:
            problems.append(f"timeout_s={timeout_s} must be positive")
        if backend not in (None, "gloo", "nccl"):
            problems.append(f"backend={backend!r} must be 'gloo', 'nccl' or None (nccl where CUDA is available)")
        if problems:
            raise ValueError("invalid TrainerWorker: " + "; ".join(problems))
        self._rank = rank
        self._config = trainer
        self._checkpoint_dir = checkpoint_dir
        self._num_mtp_layers = num_trained_mtp_layers
        self._seed = seed
        self._num_threads = num_threads
        self._timeout_s = timeout_s
        self._attachment = attachment
        self._backend = backend
        self._feeds = feeds
        self._device = torch.device("cpu")
        self._store: Any = None
        self._model: Any = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._source: ModelSource | None = None
        self._num_steps = 0

    @property
    def source(self) -> ModelSource:
        if self._source is None:
            raise RuntimeError(f"trainer rank {self._rank}: setup() has not run")
        return self._source

    def host_store(self, *, host: str = "127.0.0.1") -> int:
        """Rank 0: start the trainer group's rendezvous store on `host` at a port the OS picks; returns the port."""
        if self._rank != 0:
            raise RuntimeError(f"host_store on rank {self._rank}: rank 0 hosts the trainer group's store")
        import torch.distributed as dist

        # torch's store server listens on every interface when it opens its own socket; handing it a socket bound
        # to `host` keeps it there.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        self._store = dist.TCPStore(
            host, port, is_master=True, timeout=timedelta(seconds=self._timeout_s), wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )  # fmt: skip
        listener.detach()  # the store owns the socket from here on and closes it
        return port

    def setup(self, *, master_address: str, master_port: int) -> RankInfo:
        """Join the trainer group, initialize model parallelism, build the model, load the checkpoint, make the
        optimizer and the ModelSource. Blocks until every rank joined (at most `timeout_s`)."""
        import torch.distributed as dist
        import transformers
        from megatron.core import parallel_state as ps

        from miles_sync.embedding import attach_model  # imported here: embedding builds on this module
        from miles_sync.export.loader import load_hf_checkpoint
        from miles_sync.export.model_builder import build_gpt_model
        from miles_sync.export.raw import create_converter

        if self._num_threads is not None:
            torch.set_num_threads(self._num_threads)
        is_cuda = torch.cuda.is_available()
        backend = ("nccl" if is_cuda else "gloo") if self._backend is None else self._backend
        if is_cuda:
            # Ray leaves each GPU actor its own devices; the model lives on the first one.
            torch.cuda.set_device(0)
            self._device = torch.device("cuda", 0)
        timeout = timedelta(seconds=self._timeout_s)
        store = self._store
        if store is None:
            store = dist.TCPStore(master_address, master_port, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend, store=store, rank=self._rank, world_size=self._config.world_size, timeout=timeout
        )
        ps.initialize_model_parallel(self._config.tp, self._config.pp)
        hf_config = transformers.AutoConfig.from_pretrained(self._checkpoint_dir)
        torch.manual_seed(self._seed)
        if is_cuda:
            from megatron.core import tensor_parallel

            # megatron initializes under the CUDA RNG tracker, which must be seeded (on CPU the shims stand in).
            tensor_parallel.model_parallel_cuda_manual_seed(self._seed)
        self._model = build_gpt_model(hf_config, dtype=_config_dtype(hf_config), mtp_num_layers=self._num_mtp_layers)
        load_hf_checkpoint(
            self._model, self._checkpoint_dir, converter=create_converter(hf_config.model_type, hf_config)
        )
        self._optimizer = torch.optim.Adam(self._model.parameters(), lr=self._config.lr)
        # The same one call a pipeline with its own trainer makes: the controller reaches every rank through it.
        self._source = attach_model(
            self._model, hf_config=hf_config, name=self._attachment, collective_timeout_s=self._timeout_s,
            feeds=self._feeds,
        )
        return self._source.describe()

    def train_step(self, batch: TrainBatch) -> TrainStepResult:
        """One REINFORCE step with Adam: minimize mean over completion tokens of advantage * NLL(token).

        Every rank calls it with the same batch; data-parallel replicas take their share of the sequences and
        average gradients. Mutates the model's weights.
        """
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self._model is None or self._optimizer is None:
            raise RuntimeError(f"trainer rank {self._rank}: train_step before setup()")
        start = time.perf_counter()
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        indices = list(range(dp_rank, len(batch.sequences), dp_size))
        if not indices:
            raise ValueError(f"batch of {len(batch.sequences)} sequences leaves data-parallel rank {dp_rank} empty")
        tokens, loss_mask = _pad([batch.sequences[i] for i in indices], [batch.num_prompt_tokens[i] for i in indices])
        tokens, loss_mask = tokens.to(self._device), loss_mask.to(self._device)
        rewards = torch.tensor(batch.rewards, dtype=torch.float32)
        baseline = rewards.mean() if batch.baseline is None else torch.tensor(batch.baseline)
        advantages = (rewards - baseline)[indices].to(self._device)
        self._model.train()
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        positions = torch.arange(inputs.shape[1], device=self._device).unsqueeze(0).expand_as(inputs)
        # [batch, seq] per-token cross entropy, computed vocab-parallel across the TP ranks.
        nll = self._model(inputs, positions, None, labels=labels)
        num_tokens = loss_mask.sum()
        loss = (nll * loss_mask * advantages[:, None]).sum() / num_tokens
        self._optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if dp_size > 1:
            for param in self._model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=ps.get_data_parallel_group())
                    param.grad.div_(dp_size)
        self._optimizer.step()
        self._num_steps += 1
        mean_nll = float(((nll.detach() * loss_mask).sum() / num_tokens).item())
        return TrainStepResult(step=self._num_steps, loss=float(loss.item()), mean_token_nll=mean_nll,
                               num_tokens=int(num_tokens.item()), seconds=time.perf_counter() - start)  # fmt: skip

    def send_weights(self, *, selector: Selector) -> RankSendResult:
        """This rank's part of a sync through a transport the controller opened (see ModelSource.send)."""
        return self.source.send(selector=selector)

    def shutdown(self) -> None:
        """Release the transport, model parallelism and the process group. Idempotent."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from miles_sync.embedding import detach_model

        if self._source is not None:  # detaching shuts the source's transport and loop down
            self._source = None
            detach_model(self._attachment)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None


def _config_dtype(hf_config: Any) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None)  # transformers 4.57; older configs call it torch_dtype
    dtype = getattr(hf_config, "torch_dtype", None) if dtype is None else dtype
    if dtype is None:
        return torch.float32
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))


def _pad(sequences: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [batch, max_len] tokens, and the [batch, max_len - 1] mask of label positions that are
    completion tokens (padding never counts; causal attention keeps it from affecting earlier positions)."""
    length = max(len(s) for s in sequences)
    tokens = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length - 1, dtype=torch.float32)
    for i, (sequence, num_prompt) in enumerate(zip(sequences, num_prompt_tokens)):
        tokens[i, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        # Label position t predicts token t + 1.
        mask[i, num_prompt - 1 : len(sequence) - 1] = 1.0
    return tokens, mask
