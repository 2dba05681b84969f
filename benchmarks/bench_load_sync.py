"""The main job's syncs into two real SGLang 0.5.23 CPU servers while other clients keep requests in flight on
them, once per pause mode (two fresh servers each), in one run.

    .venv/bin/python benchmarks/bench_load_sync.py [--modes retract,in_place] [--rounds 3] [--json out.json]

Needs the server venv of launch/install_sglang.sh. Two TP=1 servers serve the built-in target checkpoint (no
draft: a CPU server runs none); for each mode the main job (`python -m launch.run`, `engines.urls` naming the two
servers, `sync.pause_mode=<mode>`) runs `--rounds` rounds while `--in-flight` clients per server each send one
greedy `/generate` of 64 tokens after another, to loopback only, until the job ends (bounded: at most
`--max-requests` per client). Printed per mode: each round's sync_s, pause_s and resume_s (in_place flushes the
prefix cache after the resume) and every engine's `prefix_cache` outcome from report.json, and of the concurrent
requests how many were answered, aborted (finish reason abort) or failed, their p50/max latency, and whether every
request's `meta_info.weight_versions` spans are in commit order and name only versions the job committed (or the
servers' starting version).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, for launch.*
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the load tier's clients

from generate_load import GenerateLoad, load_request, request_figures  # noqa: E402

from launch.sglang_venv import SGLANG_VENV_PYTHON  # noqa: E402
from miles_sync.engine.process import EngineLauncher  # noqa: E402
from miles_sync.engine.reference.checkpoints import cached_checkpoints  # noqa: E402
from miles_sync.engine.sglang import SGLangEngineSpec  # noqa: E402
from miles_sync.env import read_environment  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LOAD_REQUEST = load_request(64)


def run_job(urls: list[str], *, mode: str, rounds: int, out_dir: Path) -> dict:
    """One main-job run against `urls` in `mode`; its report.json."""
    command = [
        sys.executable,
        "-m",
        "launch.run",
        f"engines.urls=[{','.join(urls)}]",
        "engines.count=2",
        "engines.kind=sglang",
        "engines.draft_kind=none",
        "model.speculative_algorithm=null",
        f"num_rounds={rounds}",
        f"sync.pause_mode={mode}",
        f"output_dir={out_dir}",
        f"run_name={mode}",
    ]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} job failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((out_dir / mode / "report.json").read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="retract,in_place")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=2, help="concurrent clients per server")
    parser.add_argument("--max-requests", type=int, default=2000, help="per client: the load's bound")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not SGLANG_VENV_PYTHON.is_file():
        raise SystemExit(f"no SGLang server venv at {SGLANG_VENV_PYTHON.parent.parent}: run launch/install_sglang.sh")
    model = cached_checkpoints(read_environment().cache_dir) / "target"
    results: dict = {}
    for mode in args.modes.split(","):
        # Fresh servers per mode: after a 3-round job under load one server of the pair stopped answering
        # (/get_server_info timed out for the next job's connect), twice; not reproduced with 1 round, undiagnosed.
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            servers = []
            for _ in range(2):
                spec = SGLangEngineSpec(model_path=str(model), device="cpu", python=str(SGLANG_VENV_PYTHON))
                server = EngineLauncher(spec=spec, log_dir=tmp, startup_timeout_s=240.0)
                stack.callback(server.stop)
                server.start()
                servers.append(server)
            urls = [s.url for s in servers]
            load = GenerateLoad(urls, in_flight=args.in_flight, request=LOAD_REQUEST, max_requests=args.max_requests)
            with load:
                report = run_job(urls, mode=mode, rounds=args.rounds, out_dir=Path(tmp) / "runs")
            rounds = [r for r in report["rounds"] if r.get("synced")]
            # The servers' launch version and every version a sync of this run committed (its starting sync's too).
            committed = {str(r["version"]) for r in rounds if r["committed"]} | {"default"}
            committed |= set(re.findall(r"sync v(\S+) committed", report.get("starting_sync") or ""))
            order = ["default", *sorted(committed - {"default"}, key=int)]
            results[mode] = {
                "rounds": [
                    {
                        "version": r["version"],
                        "verified": r["verified"],
                        "sync_s": r["sync_s"],
                        "pause_s": r["pause_s"],
                        "resume_s": r["phases"].get("resume", 0.0),
                        "prefix_cache": r.get("prefix_cache", {}),
                    }
                    for r in rounds
                ],
                "requests": request_figures(load.answers, served_by_url=dict.fromkeys(urls, committed), order=order),
            }
            print(f"\n{mode}:")
            for r in results[mode]["rounds"]:
                print(
                    f"  v{r['version']} verified={r['verified']} sync_s {r['sync_s']:.3f} pause_s {r['pause_s']:.3f}"
                    f" resume_s {r['resume_s']:.3f} prefix cache {sorted(set(r['prefix_cache'].values()))}"
                )
            print("  requests:", json.dumps(results[mode]["requests"]))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
