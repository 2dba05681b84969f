"""Embed miles_sync in a pipeline that has its own Ray trainer actors and its own running engines.

The pipeline below stands for a Miles/slime-style trainer: it creates its actors, its process group and its
Megatron model its own way. miles_sync needs two things from it:

1. every rank calls `attach_model(model, hf_config=...)` once its model exists (see `PipelineTrainer.__init__`);
2. the driver starts one controller over the trainer actors and the engines' URLs, then calls
   `controller.sync.remote()` after each optimizer step; it returns the SyncReport (raises SyncError on failure).

    python examples/embed_in_pipeline.py --checkpoint DIR/target --engine-url http://127.0.0.1:PORT [...]
        [--address RAY_ADDRESS] [--steps N] [--tp 2] [--pp 2]

With `--pp 2` the pipeline has two stages (tp x pp ranks, stage-major as megatron-core numbers them): every rank
still makes the one `attach_model` call with its own stage's model, and the same one controller finds each
stage's source rank and syncs both stages, each through an update group of its own (miles_sync.sync.pipeline).

Without --engine-url it starts two CPU reference engines on loopback itself (the same servers a GPU cluster
would run as SGLang). The checkpoint is the one the engines serve, so trainer and engines start identical.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from contextlib import ExitStack
from datetime import timedelta

import ray
import torch

from actors.controller import create_controller
from miles_sync.config import ModelConfig, SyncConfig
from miles_sync.engine.process import EngineLauncher
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.env import socket_interface_env
from miles_sync.sync.attach import attach_model

TIMEOUT_S = 300.0


class PipelineTrainer:
    """The pipeline's own trainer rank (not a miles_sync class): gloo group, megatron-core TP x PP, a language-model
    step with SGD through megatron-core's pipeline schedule. The only miles_sync line is `attach_model`."""

    def __init__(self, *, rank: int, world_size: int, tp: int, pp: int, port: int, checkpoint: str) -> None:
        import torch.distributed as dist
        import transformers
        from megatron.core import parallel_state

        from miles_sync.export.loader import load_hf_checkpoint
        from miles_sync.export.raw import create_converter
        from miles_sync.megatron.model_builder import build_gpt_model

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        parallel_state.initialize_model_parallel(tp, pp)
        hf_config = transformers.AutoConfig.from_pretrained(checkpoint)
        self.model = build_gpt_model(hf_config, mtp_num_layers=0)
        load_hf_checkpoint(self.model, checkpoint, converter=create_converter(hf_config.model_type, hf_config))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        attach_model(self.model, hf_config=hf_config)  # <- the one call, on every rank

    def train_step(self, tokens: list[list[int]]) -> float | None:
        """One step on every rank; returns the loss on the last pipeline stage (None on the others)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batch = torch.tensor(tokens)
        inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        positions = torch.arange(inputs.shape[1]).expand_as(inputs)

        def forward_step(data_iterator, model):
            ids, targets = next(data_iterator)
            output = model(ids, positions, None, labels=targets)  # per-token NLL on the last stage

            def loss_func(nll: torch.Tensor):
                loss = nll.float().mean()
                return loss, {"loss": loss.detach()}

            return output, loss_func

        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([(inputs, labels)]),
            model=self.model,
            num_microbatches=1,
            seq_length=inputs.shape[1],
            micro_batch_size=inputs.shape[0],
            forward_only=False,
        )
        self.optimizer.step()
        return losses[0]["loss"].item() if losses else None


def language_batch(step: int, *, size: int = 4, length: int = 24) -> list[list[int]]:
    """Sequences of the reference checkpoints' language, x_{t+1} = (5 x_t + 17) mod 256."""
    batch = []
    for i in range(size):
        sequence = [(31 * step + 97 * i) % 256]
        for _ in range(length - 1):
            sequence.append((5 * sequence[-1] + 17) % 256)
        batch.append(sequence)
    return batch


def run(*, checkpoint: str, engine_urls: list[str], num_steps: int, tp: int, pp: int = 1) -> list:
    """Start the pipeline's trainers, sync after every step; returns the reports. Ray must be initialized."""
    # The pipeline's own rendezvous: a store on loopback, port from the OS (its choice, not miles_sync's).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    store = torch.distributed.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    listener.detach()  # the store owns the socket now and closes it
    trainer_class = ray.remote(PipelineTrainer).options(
        num_cpus=0.01, runtime_env={"env_vars": socket_interface_env("127.0.0.1")}
    )
    world_size = tp * pp
    trainers = [
        trainer_class.remote(rank=rank, world_size=world_size, tp=tp, pp=pp, port=port, checkpoint=checkpoint)
        for rank in range(world_size)
    ]
    controller = None
    try:
        controller = create_controller(
            trainers=trainers,
            engine_urls=engine_urls,
            sync=SyncConfig(bucket_bytes=1 << 20, sync_timeout_s=TIMEOUT_S),
            # The engines run a frozen MTP draft: the controller's selector keeps it out of every session.
            model=ModelConfig(arch="qwen3", speculative_algorithm="NEXTN", num_trained_mtp_layers=0),
            timeout_s=TIMEOUT_S,
        )
        reports = []
        for step in range(num_steps):
            losses = ray.get([t.train_step.remote(language_batch(step)) for t in trainers], timeout=TIMEOUT_S)
            report = ray.get(controller.sync.remote(), timeout=TIMEOUT_S)
            print(f"step {step}: loss {losses[-1]:.4f}; {report.summary()}", flush=True)
            reports.append(report)
        return reports
    finally:
        if controller is not None:
            ray.get(controller.close.remote(), timeout=TIMEOUT_S)
            ray.kill(controller)
        for trainer in trainers:
            ray.kill(trainer)
        del store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="HF checkpoint directory the engines serve")
    parser.add_argument("--engine-url", action="append", default=[], help="running engine (repeat per engine)")
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (each gets its own update group)")
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        if args.address is None:
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keeps Ray on loopback
            ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
        else:
            ray.init(address=args.address)
        stack.callback(ray.shutdown)
        urls = list(args.engine_url)
        if not urls:
            spec = ReferenceEngineSpec(model_dir=args.checkpoint, draft_kind="mtp", weight_layout="aiter")
            log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="engines-"))
            for _ in range(2):
                launcher = EngineLauncher(spec=spec, log_dir=log_dir)
                urls.append(launcher.start())
                stack.callback(launcher.stop)
        reports = run(checkpoint=args.checkpoint, engine_urls=urls, num_steps=args.steps, tp=args.tp, pp=args.pp)
    return 0 if all(r.committed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
