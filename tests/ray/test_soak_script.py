"""benchmarks/soak.py end to end through its command line: a short soak (colocated) writes a JSON whose
figures agree with each other and with the verdict, every sync verified, nothing of the run left behind; invalid
arguments fail before any Ray process starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "soak.py"
RUN_TIMEOUT_S = 600
NUM_SYNCS, WARMUP = 4, 1
ROLES = {
    "driver",
    "trainer[0]",
    "trainer[1]",
    "controller",
    "engine-actor[0]",
    "engine-actor[1]",
    "engine-server[0]",
    "engine-server[1]",
}


def run_soak(*args: str, timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
# Colocated only: the script is the same on every transport, and this one also shows its shared-memory accounting.
@pytest.mark.parametrize("transport", ["colocated"])
def test_short_soak_reports_consistent_figures_and_leaves_nothing_behind(tmp_path, transport):
    json_path = tmp_path / "soak.json"
    done = run_soak(
        "--syncs", str(NUM_SYNCS), "--warmup", str(WARMUP), "--transport", transport, "--json", str(json_path)
    )
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert json_path.is_file(), output
    result = json.loads(json_path.read_text())

    # The verdict, its reasons and the exit code agree.
    assert result["verdict"] in ("PASS", "FAIL"), output
    assert done.returncode == (1 if result["verdict"] == "FAIL" else 0), output
    assert bool(result["reasons"]) == (result["verdict"] == "FAIL")
    assert f"verdict: {result['verdict']}" in done.stdout
    assert result["error"] is None, output
    assert (result["num_syncs"], result["warmup"], result["transport"]) == (NUM_SYNCS, WARMUP, transport)

    # Every sync committed, verified, tagged its rollouts with the new version and moved changed tensors.
    syncs = result["syncs"]
    assert [s["version"] for s in syncs] == [str(i) for i in range(1, NUM_SYNCS + 1)]
    for s in syncs:
        assert s["committed"] and s["verified"] and s["samples_tagged"] and s["is_ok"], s
        assert s["num_tensors"] > 0 and s["num_bytes"] > 0 and s["sync_s"] > 0
    assert syncs[0]["num_changed_tensors"] is None
    assert all(0 < s["num_changed_tensors"] <= s["num_tensors"] for s in syncs[1:]), syncs
    progress = [line for line in done.stdout.splitlines() if f"/{NUM_SYNCS} v" in line]
    assert len(progress) == NUM_SYNCS, done.stdout[-3000:]
    assert 0 < result["sync_s_p50"] <= result["sync_s_p95"] <= max(s["sync_s"] for s in syncs)

    # One row per process of the fleet, its figures taken from its own series.
    processes = {p["role"]: p for p in result["processes"]}
    assert ROLES <= set(processes), sorted(processes)
    assert len({p["pid"] for p in processes.values()}) == len(processes)
    for role, p in processes.items():
        series = p["rss_series"]
        assert len(series) == NUM_SYNCS and all(v > 0 for v in series), (role, series)
        assert (p["rss_warmup"], p["rss_end"]) == (series[WARMUP - 1], series[-1])
        assert p["rss_growth_pct"] == pytest.approx(100 * (series[-1] - series[WARMUP - 1]) / series[WARMUP - 1])
        assert p["fds_warmup"] > 0 and p["fd_growth"] == p["fds_end"] - p["fds_warmup"]
        assert p["threads_warmup"] >= 1 and p["threads_end"] >= 1
        is_judged_growth = p["rss_growth_pct"] >= result["limits"]["rss_growth_pct"]
        assert is_judged_growth == any(r.startswith(f"{role} (pid") and "RSS" in r for r in result["reasons"])
    for role in ROLES - {"engine-server[0]", "engine-server[1]"}:
        assert processes[role]["rss_end_trimmed"] > 0, role  # the driver and every actor were trimmed
    assert processes["engine-server[0]"]["rss_end_trimmed"] is None
    assert min(processes[r]["rss_warmup"] for r in ROLES) > 50 * 2**20  # every one imports Python and torch or ray

    # Nothing of the run survives it: processes, shared-memory segments.
    assert result["survivors"] == [] and result["shm"]["leaked_after_shutdown"] == [], result["reasons"]
    deadline = time.monotonic() + 15
    while any(is_running(p["pid"]) for p in processes.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [r for r, p in processes.items() if is_running(p["pid"])]
    if transport == "colocated":
        # The source rank packs into a torch shared-memory segment named after its pid; the probe attributes it.
        source = processes["trainer[0]"]["pid"]
        assert any(name.startswith(f"torch_{source}_") for name in result["shm"]["seen"]), result["shm"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--syncs", "1"], "warmup < syncs"),
        (["--syncs", "4", "--warmup", "4"], "warmup < syncs"),
        (["--syncs", "4", "--set", "sync.verify=false"], "sync.verify=false"),
        (["--syncs", "4", "--set", "sync.bucket_bytes=lots"], "sync.bucket_bytes"),
    ],
)
def test_invalid_arguments_fail_before_ray_starts(args, named):
    done = run_soak(*args, timeout_s=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert named in done.stderr, done.stderr[-2000:]
    assert "Started a local Ray instance" not in done.stdout + done.stderr
