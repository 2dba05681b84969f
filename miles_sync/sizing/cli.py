"""`python -m miles_sync.sizing`: project one sync of a model on a cluster, per transport, next to published figures.

    python -m miles_sync.sizing --config qwen3-235b-a22b --trainer tp=4,pp=4,ep=16 --engines 4x8 \\
        --link-gbps 50 [--intra-gbps 450] [--link-latency-us 10] [--gpus-per-node 8] [--dtype bf16|fp8_block] \\
        [--bucket-mib 1024] [--backend nccl|gloo] [--no-verify] [--costs costs.json] [--memcpy-gbps X] \\
        [--hash-gbps X] [--json]

`--config` is an HF config.json path or the name of a shipped config (miles_sync/sizing/configs). Link
bandwidths are GB/s (10^9 bytes/s) per rank: `--link-gbps` between nodes (one GPU's NIC), `--intra-gbps` within a
node (NVLink; default the same as the link). The per-byte and per-call costs come from `--costs` (default: the
ones fitted on the development machine, a 2-core CPU host: measure yours with benchmarks/sizing_fit.py, or
override the copy and hash rates with --memcpy-gbps / --hash-gbps for GPU-resident buffers).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from miles_sync.sizing.collective import BroadcastAlgorithm
from miles_sync.sizing.costs import load_costs
from miles_sync.sizing.projection import Cluster, EngineFleet, Projection, TrainerLayout, Transport, project
from miles_sync.sizing.published import figures_for
from miles_sync.sizing.shapes import ExportDtype, model_shape

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sizing

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
GB = 1e9
BACKENDS = {"nccl": BroadcastAlgorithm.RING, "gloo": BroadcastAlgorithm.BINOMIAL}


def read_config(name_or_path: str) -> tuple[dict, str | None]:
    """(config dict, shipped name or None). Raises ValueError naming the missing file and the shipped names."""
    shipped = CONFIG_DIR / f"{name_or_path}.json"
    path = shipped if shipped.is_file() else Path(name_or_path)
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
        raise ValueError(f"--config {name_or_path!r}: no such file and no shipped config of that name ({names})")
    return json.loads(path.read_text()), (name_or_path if path == shipped else None)


def parse_trainer(text: str) -> TrainerLayout:
    """`tp=8,pp=4,ep=8[,etp=1]` (any subset; the rest 1)."""
    sizes = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key.strip() not in ("tp", "pp", "ep", "etp") or not value.strip().isdigit():
            raise ValueError(f"--trainer {text!r}: expected comma-separated tp=/pp=/ep=/etp= integers, got {part!r}")
        sizes[key.strip()] = int(value)
    return TrainerLayout(**sizes)


def parse_engines(text: str) -> EngineFleet:
    """`16x8`: 16 engines of TP 8 (a bare `16`: TP 1)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*", text)
    if match is None:
        raise ValueError(f"--engines {text!r}: expected COUNTxTP, e.g. 16x8")
    return EngineFleet(count=int(match.group(1)), tp=int(match.group(2) or 1))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m miles_sync.sizing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="HF config.json path or a shipped config name")
    parser.add_argument("--trainer", default="tp=1", help="trainer layout, e.g. tp=8,pp=4,ep=8")
    parser.add_argument("--engines", default="1", help="engine layout COUNTxTP, e.g. 16x8")
    parser.add_argument("--link-gbps", type=float, required=True, help="inter-node GB/s per rank")
    parser.add_argument("--intra-gbps", type=float, default=None, help="intra-node GB/s per rank (NVLink)")
    parser.add_argument("--link-latency-us", type=float, default=10.0, help="per message and hop (NCCL: ~10 us)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--dtype", choices=[d.value for d in ExportDtype], default=ExportDtype.BF16.value)
    parser.add_argument("--bucket-mib", type=int, default=1024)
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="nccl", help="broadcast algorithm")
    parser.add_argument("--no-verify", action="store_true", help="project syncs without checksum verification")
    parser.add_argument("--costs", default=None, help="costs JSON from benchmarks/sizing_fit.py")
    parser.add_argument("--memcpy-gbps", type=float, default=None, help="override the copy rates (pack, stage, load)")
    parser.add_argument("--hash-gbps", type=float, default=None, help="override the costs' hash rate")
    parser.add_argument("--json", action="store_true", help="print the projections as JSON instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config, name = read_config(args.config)
        shape = model_shape(config)
        trainer, engines = parse_trainer(args.trainer), parse_engines(args.engines)
        cluster = Cluster(
            link_gbps=args.link_gbps,
            intra_gbps=args.intra_gbps,
            gpus_per_node=args.gpus_per_node,
            latency_s=args.link_latency_us * 1e-6,
        )
        costs = load_costs(args.costs)
        copy = args.memcpy_gbps  # a device's copy rate: packing, staging and loading alike
        overrides = dict(memcpy_gbps=copy, fresh_copy_gbps=copy, load_gbps=copy) if copy else {}
        costs = replace(costs, **overrides, **({"hash_gbps": args.hash_gbps} if args.hash_gbps else {}))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = ExportDtype(args.dtype)
    projections = [
        project(
            shape,
            transport=transport,
            trainer=trainer,
            engines=engines,
            cluster=cluster,
            costs=costs,
            dtype=dtype,
            bucket_bytes=args.bucket_mib * 2**20,
            verify=not args.no_verify,
            staged=staged,
            algorithm=BACKENDS[args.backend],
        )
        for transport in Transport
        for staged in ((False,) if transport is Transport.P2P else (False, True))
    ]
    if args.json:
        print(json.dumps([{**asdict(p), "transport": p.transport.value} for p in projections], indent=2))
        return 0
    print(f"model {args.config}: {shape.model_type}, {shape.num_params / 1e9:.1f}B parameters, ", end="")
    print(f"{projections[0].num_bytes / GB:.1f} GB in {projections[0].num_tensors} tensors ({dtype.value})")
    print(
        f"trainer tp={trainer.tp} pp={trainer.pp} ep={trainer.ep} etp={trainer.etp}; engines {engines.count} x TP "
        f"{engines.tp} ({engines.num_ranks} ranks); link {cluster.link_gbps:g} GB/s, intra-node {cluster.intra:g} "
        f"GB/s, {args.link_latency_us:g} us/hop, {cluster.gpus_per_node} GPUs/node; {args.backend} broadcast; "
        f"bucket {args.bucket_mib} MiB; "
        f"verify {'off' if args.no_verify else 'on'}"
    )
    print(
        f"costs: memcpy {costs.memcpy_gbps:.3g} GB/s, engine load {costs.load_gbps:.3g} GB/s, hash "
        f"{costs.hash_gbps:.3g} GB/s, per bucket {costs.per_bucket_s * 1e3:.2g} ms, per tensor "
        f"{costs.per_tensor_s * 1e6:.2g} us; fitted on {costs.machine}"
    )
    print_table(projections)
    figures = figures_for(name)
    print("\npublished figures of comparable systems (whole weight update, seconds):")
    if not figures:
        print("  none cited for this config (see the README's sizing section)")
    for f in figures:
        print(f"  {f.seconds:>7.2f} s  {f.system}: {f.model}, {f.setup} [{f.source}]")
    return 0


def print_table(projections: Sequence[Projection]) -> None:
    print(
        f"\n{'transport':<20}{'sync s':>9}{'pause s':>9}{'pause/sync':>11}{'sender +GB':>11}{'engine rank +GB':>16}"
        f"  dominant terms (s)"
    )
    for p in projections:
        label = p.transport.value + (" staged" if p.stage_s > 0 else "")
        top = sorted(((v, k) for k, v in p.terms.items() if v > 0), reverse=True)[:3]
        terms = ", ".join(f"{k} {v:.1f}" for v, k in top)
        print(
            f"{label:<20}{p.sync_s:>9.1f}{p.pause_s:>9.1f}{p.pause_fraction:>11.2f}"
            f"{p.sender_extra_bytes / GB:>11.1f}{p.engine_rank_extra_bytes / GB:>16.2f}  {terms}"
        )
