"""Reference engine throughput: tokens/s and speculative accept length, with and without each draft, side by side.

    python benchmarks/bench_engine.py [--checkpoints DIR] [--batch-sizes 1,16] [--max-new-tokens 64] [--repeats 3]
                                      [--json PATH]

Rows: plain greedy decoding, then mtp, standalone and ngram drafts, and the mtp draft after one extra finalize
with the AITER layout (what a frozen draft suffers when an update session selects it and finalizes bytes it never
received). Every row generates the same greedy tokens; only the time differs. Without --checkpoints the cached
reference checkpoints are used (built on first use, about a minute).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from miles_sync.engine.reference.runner import load_runners
from miles_sync.engine.reference.scheduler import Scheduler
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.protocol import GenerateRequest, SamplingParams

# (row label, draft kind, extra finalizes of the draft)
_ROWS = (
    ("plain", "none", 0),
    ("mtp", "mtp", 0),
    ("standalone", "standalone", 0),
    ("ngram", "ngram", 0),
    ("mtp, finalized twice", "mtp", 1),
)


@dataclass(frozen=True, kw_only=True)
class Row:
    label: str
    draft_kind: str
    batch_size: int
    num_tokens: int
    load_s: float
    generate_s: float
    tokens_per_s: float
    speedup: float  # tokens/s over the plain row of the same batch size
    accept_length: float | None
    accept_rate: float | None


def _prompts(count: int, *, length: int, vocab: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(1234)
    return [tuple(torch.randint(vocab, (length,), generator=g).tolist()) for _ in range(count)]


def _measure(args, label: str, kind: str, extra_finalizes: int, batch_size: int) -> dict:
    started = time.perf_counter()
    draft_path = args.checkpoints / "draft" if kind == "standalone" else None
    target, draft = load_runners(
        args.checkpoints / "target", draft_kind=kind, draft_path=draft_path, layout=WeightLayout(args.layout)
    )
    for _ in range(extra_finalizes):
        draft.finalize_all()
    scheduler = Scheduler(target=target, draft=draft, draft_kind=kind, spec_steps=args.spec_steps)
    load_s = time.perf_counter() - started
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    prompts = _prompts(batch_size * args.rounds, length=args.prompt_len, vocab=target.model.config.vocab_size)
    try:
        scheduler.submit(GenerateRequest(input_ids=prompts[0], sampling_params=params)).result(timeout=600)  # warm-up
        # Best of `repeats`: on a shared machine the slowest run measures the neighbours, not the engine.
        generate_s = float("inf")
        for _ in range(args.repeats):
            scheduler.reset_spec_stats()
            started = time.perf_counter()
            responses = []
            for r in range(args.rounds):
                batch = prompts[r * batch_size : (r + 1) * batch_size]
                futures = [scheduler.submit(GenerateRequest(input_ids=p, sampling_params=params)) for p in batch]
                responses += [f.result(timeout=600) for f in futures]
            generate_s = min(generate_s, time.perf_counter() - started)
        accept_length = scheduler.avg_spec_accept_length
    finally:
        scheduler.shutdown()
    num_tokens = sum(r.meta_info.completion_tokens for r in responses)
    rates = [r.meta_info.spec_accept_rate for r in responses if r.meta_info.spec_accept_rate is not None]
    return dict(
        label=label,
        draft_kind=kind,
        batch_size=batch_size,
        num_tokens=num_tokens,
        load_s=load_s,
        generate_s=generate_s,
        tokens_per_s=num_tokens / generate_s,
        accept_length=accept_length,
        accept_rate=sum(rates) / len(rates) if rates else None,
        outputs=[r.output_ids for r in responses],
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", type=Path, default=None, help="directory with target/ and draft/")
    parser.add_argument("--batch-sizes", default="1,16", help="concurrent requests per round, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of batch-size requests per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per row; the fastest is reported")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--spec-steps", type=int, default=3)
    parser.add_argument("--layout", default="aiter", choices=[m.value for m in WeightLayout])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.checkpoints is None:
        from miles_sync.engine.reference.checkpoints import cached_checkpoints
        from miles_sync.env import read_environment

        args.checkpoints = cached_checkpoints(read_environment().cache_dir)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    rows: list[Row] = []
    for batch_size in batch_sizes:
        plain_outputs, plain_tokens_per_s = None, None
        for label, kind, extra in _ROWS:
            m = _measure(args, label, kind, extra, batch_size)
            outputs = m.pop("outputs")
            if plain_outputs is None:
                plain_outputs, plain_tokens_per_s = outputs, m["tokens_per_s"]
            elif outputs != plain_outputs:
                raise SystemExit(f"row {label!r} generated different greedy tokens from plain decoding")
            rows.append(Row(**m, speedup=m["tokens_per_s"] / plain_tokens_per_s))

    print(
        f"reference engine, {args.checkpoints}: layout {args.layout}, k={args.spec_steps}, "
        f"{args.max_new_tokens} new tokens x {args.rounds} rounds, best of {args.repeats}, {args.threads} thread(s)"
    )
    print(
        f"{'draft':<22}{'batch':>6}{'tokens':>8}{'load s':>8}{'gen s':>8}{'tok/s':>9}{'speedup':>9}"
        f"{'accept len':>11}{'accept rate':>12}"
    )
    for r in rows:
        print(
            f"{r.label:<22}{r.batch_size:>6}{r.num_tokens:>8}{r.load_s:>8.2f}{r.generate_s:>8.2f}{r.tokens_per_s:>9.0f}"
            f"{r.speedup:>8.2f}x{_fmt(r.accept_length, '.2f'):>11}{_fmt(r.accept_rate, '.2f'):>12}"
        )
    if args.json is not None:
        payload = {"config": {k: str(v) for k, v in vars(args).items()}, "rows": [asdict(r) for r in rows]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
