"""Two commits' benchmarks interleaved on one machine: how a change's speed claim is shown.

    python benchmarks/bench_compare.py BASE [--rounds N] [--json PATH] [-- BENCHMARK OPTIONS]
    python benchmarks/bench_sync.py --compare BASE [BENCHMARK OPTIONS]

Extracts commit BASE with `git archive` into a temporary directory (the working tree and the repository are left
as they are), then runs `benchmarks/bench_sync.py BENCHMARK OPTIONS` from BASE and from this checkout alternately,
base first (base, this, base, this, ...; `--rounds` pairs, default 2), same interpreter, same options, each run
writing its own JSON. Every headline key either run reports (the JSON's top-level numbers and its `topologies`) is
printed with each checkout's value per round, and the ratio this / base as the median of the rounds' ratios
[min-max]: a ratio whose range spans 1.0 is no difference this machine resolves (`resolved: false`). A JSON written
before the benchmark took repetitions holds plain numbers; one after holds each key's median (its `spread` beside),
and both read the same here. Both checkouts must accept the options given (an option the older one lacks fails its
run, named). Ray, engines and every other process of a run are gone before the next run starts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _repeat import is_number

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 3 * 3600  # a full bench_sync run takes ~20 min here


def log(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def extract(commit: str, into: Path) -> str:
    """Commit `commit`'s tree into `into`; its full hash."""
    full = subprocess.run(
        ["git", "rev-parse", "--verify", f"{commit}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if full.returncode != 0:
        raise SystemExit(f"compare: {commit!r} is not a commit of {REPO}: {full.stderr.strip()}")
    archive = subprocess.run(["git", "archive", full.stdout.strip()], cwd=REPO, capture_output=True, timeout=600)
    if archive.returncode != 0:
        raise SystemExit(f"compare: git archive {commit} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True, timeout=600)
    return full.stdout.strip()


def run_benchmark(checkout: Path, options: Sequence[str], *, json_path: Path, log_path: Path) -> dict:
    """One bench_sync run from `checkout` (its own miles_sync first on the path); its JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    command = [sys.executable, str(checkout / "benchmarks" / "bench_sync.py"), *options, "--json", str(json_path)]
    command += ["--png", str(json_path.with_suffix(".png")), "--log-dir", str(log_path.parent / "engines")]
    with log_path.open("w") as out:
        done = subprocess.run(
            command, cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
        )
    if done.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"compare: the run from {checkout} failed (exit {done.returncode}); its output ends:\n{tail}")
    return json.loads(json_path.read_text())


def headline(result: dict) -> dict[str, float]:
    """The headline keys of one run's JSON: top-level numbers and `topologies.<key>`."""
    keys = {k: float(v) for k, v in result.items() if _is_figure(k, v)}
    keys |= {f"topologies.{k}": float(v) for k, v in (result.get("topologies") or {}).items() if _is_figure(k, v)}
    return keys


def _is_figure(key: str, value: object) -> bool:
    return is_number(value) and key not in {"wall_s", "cpu_count", "repeats", "repetitions"}


def compare_rows(base: Sequence[dict[str, float]], this: Sequence[dict[str, float]]) -> list[dict]:
    """Per key either side reports: each round's values and the ratio this / base over the rounds."""
    rows = []
    for key in sorted(set().union(*base, *this)):
        b = [r.get(key, math.nan) for r in base]
        t = [r.get(key, math.nan) for r in this]
        ratios = [x / y if y not in (0.0,) and not math.isnan(x + y) else math.nan for x, y in zip(t, b)]
        known = [r for r in ratios if not math.isnan(r)]
        rows.append(
            {
                "key": key,
                "base": b,
                "this": t,
                "ratio": statistics.median(known) if known else math.nan,
                "ratio_min": min(known, default=math.nan),
                "ratio_max": max(known, default=math.nan),
                "resolved": bool(known) and (min(known) > 1.0 or max(known) < 1.0),
                "missing": "base" if all(math.isnan(x) for x in b) else "this" if all(math.isnan(x) for x in t) else "",
            }
        )
    return rows


def print_rows(rows: Sequence[dict], *, base: str, this: str) -> None:
    print(f"\nthis ({this}) / base ({base}), same machine, alternating runs; ratio: median of the rounds' [min-max]")
    print(f"  {'key':<58}{'base':>22}{'this':>22}{'this/base':>24}")
    for r in rows:
        b = "/".join(f"{x:.3f}" for x in r["base"])
        t = "/".join(f"{x:.3f}" for x in r["this"])
        if r["missing"]:
            ratio = f"only in {'this' if r['missing'] == 'base' else 'base'}"
        else:
            ratio = f"{r['ratio']:.3f} [{r['ratio_min']:.3f}-{r['ratio_max']:.3f}]"
            ratio += "" if r["resolved"] else " ~"
        print(f"  {r['key']:<58}{b:>22}{t:>22}{ratio:>24}")
    print("  ~ : the rounds' ratios span 1.0 (no difference this machine resolves)")
    rounds = len(rows[0]["base"]) if rows else 0
    if rounds < 3:
        print(f"  {rounds} round(s): an unmarked ratio is a direction, not yet a measured difference (--rounds 3+)")


def compare_main(base: str, options: Sequence[str], *, rounds: int = 2, json_path: Path | None = None) -> int:
    if rounds < 1:
        raise SystemExit("compare: --rounds must be >= 1")
    options = _without_outputs(options)
    head, _, dirty = git_commit().partition("+")
    this_label = head[:12] + (f"+{dirty}" if dirty else "")
    with tempfile.TemporaryDirectory(prefix="miles-sync-compare-") as tmp:
        work = Path(tmp)
        (work / "base").mkdir()
        base_commit = extract(base, work / "base")
        log(f"base {base_commit[:12]} extracted to {work / 'base'}; this checkout {this_label}; {rounds} round(s)")
        results: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
        for i in range(rounds):
            for side, checkout in (("base", work / "base"), ("this", REPO)):
                out = work / f"{side}-{i}"
                out.mkdir()
                log(f"round {i + 1}/{rounds}: {side} ({checkout}) bench_sync.py {' '.join(options)}")
                started = time.perf_counter()
                result = run_benchmark(checkout, options, json_path=out / "bench.json", log_path=out / "run.log")
                log(f"  done in {time.perf_counter() - started:.0f} s")
                results[side].append(headline(result))
    rows = compare_rows(results["base"], results["this"])
    print_rows(rows, base=base_commit[:12], this=this_label)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        summary = {"base": base_commit, "this": this_label, "options": list(options), "rounds": rounds, "keys": rows}
        json_path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"\nwrote {json_path}")
    return 0


def _without_outputs(options: Sequence[str]) -> list[str]:
    """The options without --json/--png/--log-dir (every run writes its own) and any --compare."""
    out, skip = [], False
    for option in options:
        if skip:
            skip = False
            continue
        name = option.split("=", 1)[0]
        if name in ("--json", "--png", "--log-dir", "--compare"):
            skip = "=" not in option
            continue
        out.append(option)
    return out


def git_commit() -> str:
    """The checkout's HEAD (with '+dirty' when tracked files differ), or 'unknown' outside a git checkout (an
    extracted base): what a bench_sync JSON records as its `commit`, and this comparison's label for its side."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 1 else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the commit to compare this checkout against")
    parser.add_argument("--rounds", type=int, default=2, help="base/this pairs of runs (default 2)")
    parser.add_argument("--json", type=Path, default=Path("outputs/bench_compare.json"))
    parser.add_argument("options", nargs=argparse.REMAINDER, help="after --: bench_sync.py options for both runs")
    args = parser.parse_args(argv)
    options = args.options[1:] if args.options[:1] == ["--"] else args.options
    return compare_main(args.base, options, rounds=args.rounds, json_path=args.json)


if __name__ == "__main__":
    sys.exit(main())
