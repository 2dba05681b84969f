"""`TrainerWorker`: the trainer the launch code runs (one Ray actor per rank).

Its own gloo group (at its node's address: loopback on one machine), megatron-core model parallelism, the model
built from the HF config the engines serve and loaded from the same checkpoint (so both copies start bit-identical),
and a real optimizer: a policy-gradient step with Adam on given token sequences and their advantages (the job
passes GRPO group advantages). Its share of every sync is a `ModelSource`
(`miles_sync.sync.source`), attached under its attachment name like any pipeline's model.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from miles_sync.config import SyncConfig, TrainerConfig
from miles_sync.env import LOOPBACK_HOST
from miles_sync.export.registry import ConversionMode
from miles_sync.megatron.lora import LoraSpec
from miles_sync.sync.selector import selector_input_problems
from miles_sync.sync.source import ModelSource, RankInfo
from miles_sync.transport.feeds import FeedPlan
from miles_sync.wire.dtypes import config_dtype
from miles_sync.wire.text import raise_if

__all__ = ["CompletionLogprobs", "ScoreBatch", "TrainBatch", "TrainStepResult", "TrainerWorker"]


@dataclass(frozen=True, kw_only=True)
class TrainBatch:
    """Token sequences (prompt + completion) and one reward each. The loss covers completion tokens only.

    `advantages`: each sequence's weight in the policy-gradient loss (e.g. GRPO's group-relative ones); None takes
    reward - `baseline`, where a None baseline is the batch's mean reward.
    """

    sequences: tuple[tuple[int, ...], ...]
    num_prompt_tokens: tuple[int, ...]
    rewards: tuple[float, ...]
    baseline: float | None = None
    advantages: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        problems = [] if self.sequences else ["sequences is empty"]
        if not len(self.sequences) == len(self.num_prompt_tokens) == len(self.rewards):
            problems.append(
                f"{len(self.sequences)} sequences, {len(self.num_prompt_tokens)} prompt lengths and "
                f"{len(self.rewards)} rewards must be as many"
            )
        if self.advantages is not None and len(self.advantages) != len(self.sequences):
            problems.append(f"{len(self.advantages)} advantages for {len(self.sequences)} sequences")
        if self.advantages is not None and self.baseline is not None:
            problems.append("give advantages or a baseline, not both")
        bad = [i for i, (s, n) in enumerate(zip(self.sequences, self.num_prompt_tokens)) if not 1 <= n < len(s)]
        if bad:
            problems.append(f"sequences {bad} need 1 <= num_prompt_tokens < length (at least one completion token)")
        raise_if(problems, what="invalid TrainBatch")


@dataclass(frozen=True, kw_only=True)
class ScoreBatch:
    """Token sequences (prompt + completion) whose completion tokens' log-probabilities are asked for.

    `temperature`: the log-probs are those of softmax(logits / temperature), the distribution a rollout engine
    samples from (and SGLang's `output_token_logprobs`); 0 (greedy) scores the logits as they are.
    """

    sequences: tuple[tuple[int, ...], ...]
    num_prompt_tokens: tuple[int, ...]
    temperature: float = 1.0

    def __post_init__(self) -> None:
        problems = [] if self.sequences else ["sequences is empty"]
        if len(self.sequences) != len(self.num_prompt_tokens):
            problems.append(f"{len(self.sequences)} sequences and {len(self.num_prompt_tokens)} prompt lengths")
        bad = [i for i, (s, n) in enumerate(zip(self.sequences, self.num_prompt_tokens)) if not 1 <= n < len(s)]
        if bad:
            problems.append(f"sequences {bad} need 1 <= num_prompt_tokens < length (at least one completion token)")
        if not self.temperature >= 0:
            problems.append(f"temperature={self.temperature} must be non-negative")
        raise_if(problems, what="invalid ScoreBatch")


@dataclass(frozen=True, kw_only=True)
class CompletionLogprobs:
    """One log-probability per completion token of each sequence of a ScoreBatch, in order."""

    logprobs: tuple[tuple[float, ...], ...]
    weight_step: int  # optimizer steps the weights that scored them had taken


@dataclass(frozen=True, kw_only=True)
class TrainStepResult:
    step: int  # optimizer steps taken so far, this one included
    loss: float  # the policy-gradient loss of this step
    mean_token_nll: float  # mean negative log-likelihood of the completion tokens, before the step
    num_tokens: int
    seconds: float


class TrainerWorker:
    """One Megatron rank of any tp x pp x dp (x ep x etp) layout: process group, this rank's pipeline stage of the
    model, checkpoint, optimizer, and its ModelSource.

    Lifecycle: construct on every rank (cheap), `host_store()` on rank 0, `setup(master_port=...)` on every rank at
    the same time, then `train_step` on every rank with the same batch, and syncs through `source`. `feeds`: the
    colocated feed plan of the placement (see ModelSource), None to feed every engine rank from the source.
    `conversion`: how every rank exports (raw converters or megatron-bridge; `sync.conversion`); setup refuses a
    model the mode cannot export (MTP layers or MoE in bridge mode) before building it.
    `micro_batch_size`: sequences per microbatch of megatron-core's pipeline schedule; None takes one sequence per
    microbatch with pipeline stages (so stages overlap) and a data-parallel rank's whole share without.
    `timeout_s` bounds set-up (the store, joining the group); `collective_timeout_s` (None: `timeout_s`) bounds every
    collective after it, megatron's model-parallel groups in `train_step` and the source's in a sync, so a rank whose
    peer died fails after that long instead of the start-up timeout.
    MoE models under tensor parallelism train with sequence parallelism (megatron-core's only way), so `train_step`
    pads each batch's sequence length to a multiple of tp with positions that weigh nothing.
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
        collective_timeout_s: float | None = None,
        attachment: str = "default",
        backend: str | None = None,
        feeds: FeedPlan | None = None,
        conversion: ConversionMode | str = ConversionMode.RAW,
        micro_batch_size: int | None = None,
        lora: LoraSpec | None = None,
        lora_flatten_min_bytes: int = 2**20,
    ) -> None:
        """`lora`: train LoRA adapters on a frozen base (miles_sync.megatron.lora) and sync only them (the source's
        `adapter_payload`); None trains and syncs every weight."""
        problems = []
        if not 0 <= rank < trainer.world_size:
            problems.append(f"rank={rank} is outside [0, {trainer.world_size}) (tp*pp*dp)")
        problems += selector_input_problems(speculative_algorithm=None, num_trained_mtp_layers=num_trained_mtp_layers)
        if num_threads is not None and num_threads < 1:
            problems.append(f"num_threads={num_threads} must be at least 1 (or None)")
        if micro_batch_size is not None and micro_batch_size < 1:
            problems.append(f"micro_batch_size={micro_batch_size} must be at least 1 (or None)")
        if not timeout_s > 0:
            problems.append(f"timeout_s={timeout_s} must be positive")
        if collective_timeout_s is not None and not collective_timeout_s > 0:
            problems.append(f"collective_timeout_s={collective_timeout_s} must be positive (or None)")
        if backend not in (None, "gloo", "nccl"):
            problems.append(f"backend={backend!r} must be 'gloo', 'nccl' or None (nccl where CUDA is available)")
        try:
            conversion = ConversionMode(conversion)
        except ValueError:
            problems.append(f"conversion={conversion!r} must be one of {[m.value for m in ConversionMode]}")
        raise_if(problems, what="invalid TrainerWorker")
        self._conversion = conversion
        self._rank = rank
        self._config = trainer
        self._checkpoint_dir = checkpoint_dir
        self._num_mtp_layers = num_trained_mtp_layers
        self._seed = seed
        self._num_threads = num_threads
        self._timeout_s = timeout_s
        self._collective_timeout_s = timeout_s if collective_timeout_s is None else collective_timeout_s
        self._attachment = attachment
        self._backend = backend
        self._feeds = feeds
        self._micro_batch_size = micro_batch_size
        self._lora = lora
        self._lora_flatten_min_bytes = lora_flatten_min_bytes
        self._adapters: Any = None
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

    @property
    def model(self) -> torch.nn.Module:
        """This rank's stage of the megatron-core model (read it; `train_step` is what changes it)."""
        if self._model is None:
            raise RuntimeError(f"trainer rank {self._rank}: setup() has not run")
        return self._model

    def host_store(self, *, host: str = LOOPBACK_HOST) -> int:
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
            host,
            port,
            is_master=True,
            timeout=timedelta(seconds=self._timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
        listener.detach()  # the store owns the socket from here on and closes it
        return port

    def setup(self, *, master_address: str, master_port: int) -> RankInfo:
        """Join the trainer group, initialize model parallelism, build the model, load the checkpoint, make the
        optimizer and the ModelSource. Blocks until every rank joined (at most `timeout_s`)."""
        import torch.distributed as dist
        import transformers
        from megatron.core import parallel_state as ps

        from miles_sync.export.loader import load_hf_checkpoint
        from miles_sync.export.raw import create_converter
        from miles_sync.megatron.model_builder import build_gpt_model
        from miles_sync.sync.attach import attach_model

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
        layout = self._config
        # The default group's timeout stays the set-up one (its rendezvous waits for every rank to arrive); the
        # model-parallel groups, which carry all of train_step's collectives, get the collective timeout.
        ps.initialize_model_parallel(
            layout.tp,
            layout.pp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            distributed_timeout_minutes=self._collective_timeout_s / 60,
        )
        hf_config = transformers.AutoConfig.from_pretrained(self._checkpoint_dir)
        problems = SyncConfig(conversion=self._conversion).checkpoint_problems(
            hf_config.to_dict(), num_trained_mtp_layers=self._num_mtp_layers
        )
        problems += layout.checkpoint_problems(hf_config.to_dict())
        raise_if(problems, what=f"trainer rank {self._rank}, checkpoint {self._checkpoint_dir}")
        torch.manual_seed(self._seed)
        if is_cuda:
            from megatron.core import tensor_parallel

            # megatron initializes under the CUDA RNG tracker, which must be seeded (on CPU the shims stand in).
            tensor_parallel.model_parallel_cuda_manual_seed(self._seed)
        self._model = build_gpt_model(hf_config, dtype=config_dtype(hf_config), mtp_num_layers=self._num_mtp_layers)
        load_hf_checkpoint(
            self._model, self._checkpoint_dir, converter=create_converter(hf_config.model_type, hf_config)
        )
        trained = self._model.parameters()
        if self._lora is not None:
            from miles_sync.export.megatron import model_chunks
            from miles_sync.megatron.lora import apply_lora

            self._adapters = apply_lora(model_chunks(self._model), self._lora, seed=self._seed)
            trained = self._adapters.parameters()  # the base is frozen: the step trains the adapters only
        self._optimizer = torch.optim.Adam(trained, lr=self._config.lr)
        # The same one call a pipeline with its own trainer makes: the controller reaches every rank through it.
        self._source = attach_model(
            self._model,
            hf_config=hf_config,
            conversion=self._conversion,
            name=self._attachment,
            collective_timeout_s=self._collective_timeout_s,
            feeds=self._feeds,
        )
        if self._adapters is not None:
            self._source.attach_adapters(self._adapters, flatten_min_bytes=self._lora_flatten_min_bytes)
        return self._source.describe()

    def train_step(self, batch: TrainBatch) -> TrainStepResult:
        """One REINFORCE step with Adam: minimize sum over completion tokens of advantage * NLL(token), divided by
        the batch's number of completion tokens.

        Every rank calls it with the same batch; data-parallel replicas take their share of the sequences, run it
        through megatron-core's pipeline schedule and sum gradients, so every layout takes the same step as one
        rank on the whole batch (up to float reduction order). Every rank returns the same result (computed on
        the last pipeline stage). Mutates the model's weights.
        """
        from megatron.core import parallel_state as ps

        from miles_sync.megatron.lora import reduce_adapter_gradients
        from miles_sync.megatron.schedule import batch_totals, forward_backward, reduce_gradients

        if self._model is None or self._optimizer is None:
            raise RuntimeError(f"trainer rank {self._rank}: train_step before setup()")
        start = time.perf_counter()
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        # Sequence parallelism splits every sequence over the TP ranks, so its length must divide by tp.
        seq_multiple = ps.get_tensor_model_parallel_world_size() if self._model.config.sequence_parallel else 1
        tokens, loss_mask = _pad(batch.sequences, batch.num_prompt_tokens, seq_multiple=seq_multiple)
        if batch.advantages is None:
            rewards = torch.tensor(batch.rewards, dtype=torch.float32)
            advantages = rewards - (rewards.mean() if batch.baseline is None else torch.tensor(batch.baseline))
        else:
            advantages = torch.tensor(batch.advantages, dtype=torch.float32)
        num_tokens = loss_mask.sum()
        # Normalized by the whole batch's token count, so the data-parallel shares' gradients simply add up.
        nll_weights = loss_mask / num_tokens
        loss_weights = nll_weights * advantages[:, None]
        # Every data-parallel rank runs the same rows x seq (the MoE allgather and p2p buffers need equal shapes);
        # padding rows weigh nothing.
        micro_batch_size = self._micro_batch_size
        num_rows = -(-len(batch.sequences) // dp_size)
        if micro_batch_size is None:
            micro_batch_size = 1 if self._config.pp > 1 else num_rows
        num_rows = -(-num_rows // micro_batch_size) * micro_batch_size
        rows = torch.arange(dp_rank, len(batch.sequences), dp_size)
        share = [_rows(t, rows, num_rows) for t in (tokens, nll_weights, loss_weights)]
        share_tokens, share_nll_weights, share_loss_weights = (t.to(self._device) for t in share)
        self._optimizer.zero_grad(set_to_none=True)
        local = forward_backward(
            self._model,
            input_ids=share_tokens[:, :-1].contiguous(),
            labels=share_tokens[:, 1:].contiguous(),
            loss_weights=share_loss_weights,
            nll_weights=share_nll_weights,
            micro_batch_size=micro_batch_size,
        )
        reduce_gradients(self._model)
        if self._adapters is not None:
            reduce_adapter_gradients(self._adapters)
        self._optimizer.step()
        self._num_steps += 1
        loss, mean_nll = batch_totals(local).tolist()
        return TrainStepResult(
            step=self._num_steps,
            loss=loss,
            mean_token_nll=mean_nll,
            num_tokens=int(num_tokens.item()),
            seconds=time.perf_counter() - start,
        )

    def completion_logprobs(self, batch: ScoreBatch) -> CompletionLogprobs:
        """The current weights' log-probability of every completion token of `batch` (forward only, through
        megatron-core's schedule; no weight or optimizer state changes). Every rank calls it with the same batch
        and gets the same answer: each rank scores every sequence (data-parallel replicas repeat the work, which
        keeps expert-parallel shapes equal) and the last pipeline stage broadcasts its result."""
        from megatron.core import parallel_state as ps

        from miles_sync.megatron.schedule import forward_logprobs

        if self._model is None:
            raise RuntimeError(f"trainer rank {self._rank}: completion_logprobs before setup()")
        seq_multiple = ps.get_tensor_model_parallel_world_size() if self._model.config.sequence_parallel else 1
        tokens, loss_mask = _pad(batch.sequences, batch.num_prompt_tokens, seq_multiple=seq_multiple)
        num_rows = len(batch.sequences)
        micro_batch_size = 1 if self._config.pp > 1 else num_rows
        tokens = tokens.to(self._device)
        logprobs = forward_logprobs(
            self._model,
            input_ids=tokens[:, :-1].contiguous(),
            labels=tokens[:, 1:].contiguous(),
            temperature=batch.temperature if batch.temperature > 0 else 1.0,
            micro_batch_size=micro_batch_size,
        ).cpu()
        rows = tuple(tuple(logprobs[i][loss_mask[i] > 0].tolist()) for i in range(num_rows))
        return CompletionLogprobs(logprobs=rows, weight_step=self._num_steps)

    def shutdown(self) -> None:
        """Release the transport, model parallelism and the process group. Idempotent."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from miles_sync.sync.attach import detach_model

        if self._source is not None:  # detaching shuts the source's transport and loop down
            self._source = None
            detach_model(self._attachment)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None


def _rows(tensor: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`tensor[rows]` followed by zero rows up to `num_rows`."""
    out = tensor.new_zeros((num_rows, *tensor.shape[1:]))
    out[: len(rows)] = tensor[rows]
    return out


def _pad(
    sequences: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int], *, seq_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [batch, length] tokens, and the [batch, length - 1] mask of label positions that are completion
    tokens (padding never counts; causal attention keeps it from affecting earlier positions, and MoE routing drops
    no token, so padded tokens never displace real ones). length - 1 is the smallest multiple of `seq_multiple`
    that holds the longest sequence's labels."""
    length = -(-(max(len(s) for s in sequences) - 1) // seq_multiple) * seq_multiple + 1
    tokens = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length - 1, dtype=torch.float32)
    for i, (sequence, num_prompt) in enumerate(zip(sequences, num_prompt_tokens)):
        tokens[i, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        # Label position t predicts token t + 1.
        mask[i, num_prompt - 1 : len(sequence) - 1] = 1.0
    return tokens, mask
