"""The main job end to end through its real entry point (`python -m launch.run`): the default run holds the
frozen draft's accept length with every sync verified; runs with pipeline stages (one update group per stage) and
with an expert-parallel Qwen3-MoE trainer verify every round; the frozen-draft-bug demo collapses the accept
length; invalid config values fail before any actor starts; a job submitted to a `ray start --head` cluster on
loopback completes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 600
SMALL = ["rollout.num_prompts=3", "rollout.max_new_tokens=16"]


def run_main(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "launch.run", f"output_dir={tmp_path}", *overrides]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def read_report(tmp_path: Path, run_name: str) -> dict:
    run_dir = tmp_path / run_name
    png = (run_dir / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    return json.loads((run_dir / "report.json").read_text())


def test_default_run_holds_accept_length_and_verifies_every_sync(tmp_path):
    done = run_main(tmp_path, *SMALL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = read_report(tmp_path, "default")
    assert report["status"] == "completed"
    rounds, baseline = report["rounds"], report["baseline"]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5]
    assert [int(r["version"]) for r in rounds] == [1, 2, 3, 4, 5]
    for r in rounds:
        assert r["committed"] and r["verified"] and r["samples_tagged"], r
        assert r["selector"] == "target" and r["num_tensors"] > 0 and r["gbps"] > 0
        assert set(r["phases"]) == {"stage", "pause", "export", "send", "finalize", "verify", "resume"}
        assert r["pause_s"] == r["phases"]["pause"] and r["sync_s"] >= r["phases"]["send"]
    assert baseline["accept_length"] > 2.0
    assert rounds[-1]["accept_length"] >= 0.9 * baseline["accept_length"], (baseline, rounds)
    assert len({r["loss"] for r in rounds}) > 1  # real optimizer steps: the loss moves
    assert report["packages"]["torch"] and report["config"]["trainer"]["tp"] == 2
    # The per-round table is printed: one row per round, after the header.
    header = next(i for i, line in enumerate(done.stdout.splitlines()) if line.split()[:2] == ["round", "version"])
    rows = done.stdout.splitlines()[header + 1 : header + 7]
    assert [row.split()[0] for row in rows] == ["0", "1", "2", "3", "4", "5"], rows


def test_frozen_draft_bug_demo_collapses_accept_length(tmp_path):
    done = run_main(tmp_path, "demo=frozen_draft_bug", "num_rounds=2", *SMALL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = read_report(tmp_path, "frozen_draft_bug")
    assert report["config"]["sync"]["selector"] == "all"
    assert report["config"]["engines"]["finalize_policy"] == "sglang"
    assert report["baseline"]["accept_length"] > 2.0
    assert all(r["committed"] and not r["verified"] and r["selector"] == "all" for r in report["rounds"])
    assert report["rounds"][-1]["accept_length"] <= 1.2, report["rounds"]


@pytest.mark.parametrize(
    "layout",
    [("trainer.pp=2", "trainer.tp=1"), ("model.arch=qwen3_moe", "trainer.ep=2")],
    ids=["pipeline_stages", "expert_parallel_moe"],
)
def test_pipeline_and_expert_parallel_runs_verify_every_round(tmp_path, layout):
    done = run_main(tmp_path, *layout, "num_rounds=2", *SMALL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = read_report(tmp_path, "default")
    for override in layout:  # the run used the layout asked for
        key, value = override.split("=")
        section, field = key.split(".")
        assert str(report["config"][section][field]) == value, (override, report["config"][section])
    assert report["status"] == "completed" and [r["round"] for r in report["rounds"]] == [1, 2]
    for r in report["rounds"]:
        assert r["committed"] and r["verified"] and r["samples_tagged"] and r["selector"] == "target", r
    if "trainer.pp=2" in layout:
        assert "from 2 pipeline stages (one update group each)" in done.stdout
    else:
        assert report["config"]["model"]["arch"] == "qwen3_moe"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("sync.transport=carrier_pigeon", "sync.transport"),
        ("trainer.tp=0", "tp=0"),
        ("engines.finalize_policy=loose", "engines.finalize_policy"),
        ("sync.bucket_bytes=lots", "sync.bucket_bytes"),
    ],
)
def test_invalid_values_fail_before_any_actor_starts(tmp_path, override, named):
    start = time.monotonic()
    done = run_main(tmp_path, override)
    assert done.returncode != 0
    assert named in done.stderr, done.stderr[-2000:]
    assert "Started a local Ray instance" not in done.stdout + done.stderr
    assert not (tmp_path / "default").exists()
    assert time.monotonic() - start < 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ray_job_submit_to_a_local_head(tmp_path):
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    env.pop("RAY_ADDRESS", None)
    gcs_port, dashboard_port = free_port(), free_port()
    ray_cli = str(Path(venv_bin) / "ray")
    start = [
        ray_cli,
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs_port}",
        "--num-cpus=2",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        "--disable-usage-stats",
    ]
    started = subprocess.run(start, env=env, capture_output=True, text=True, timeout=180)
    try:
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        submit = [
            "bash",
            str(REPO / "launch" / "submit.sh"),
            "--address",
            f"http://127.0.0.1:{dashboard_port}",
            f"output_dir={tmp_path}",
            "num_rounds=1",
            "run_name=submitted",
            *SMALL,
        ]
        done = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-4000:]
        assert "succeeded" in output, output[-4000:]
        report = read_report(tmp_path, "submitted")
        assert report["status"] == "completed" and len(report["rounds"]) == 1
        assert report["rounds"][0]["verified"]
        assert f"ray cluster at 127.0.0.1:{gcs_port}" in output  # it joined the submitted-to cluster
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
