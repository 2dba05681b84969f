"""The main job through its own entry point (`python -m launch.run`) on real SGLang 0.5.23 CPU servers that the job
launches itself: the rollout actors start the servers from the default `engines.sglang_python` (the venv of
launch/install_sglang.sh) with `engines.device: auto` (the CPU here), and the job's syncs run with
`sync.pause_mode=retract` (the updates flush the prefix cache) and `rollout.overlap` (each round's rollouts start
before the trainer's step and run through the sync). Two short rounds: every sync committed and verified
engine-exact by the servers' own checker, every engine's prefix cache flushed with its updates and no session
/flush_cache sent; every round's rollouts have tokens from the version before the sync (they started before the
step: mutation, overlap ignored) and only from it and the synced one, in that order, and the synced version's
tokens' log-probs agree with the trainer's (a retracted request is prefilled again on the new weights). (Learning
over 10 rounds on real servers is a docs/sglang.md run; this checks the launch path and the job's sync on real
servers.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 600
LOGPROB_BOUND = 1e-4  # as tests/ray/test_main_job.py: an exact sync leaves float32 rounding only


def test_the_main_job_launches_real_servers_and_verifies_every_retract_sync(tmp_path, sglang_python):
    command = [
        sys.executable,
        "-m",
        "launch.run",
        f"output_dir={tmp_path}",
        "engines.kind=sglang",
        "engines.draft_kind=none",  # a CPU server runs no speculative decoding
        "model.speculative_algorithm=null",
        "num_rounds=2",
        "sync.pause_mode=retract",
        "rollout.overlap=true",
        "rollout.num_prompts=3",
        "rollout.max_new_tokens=16",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "starting 2 sglang engine(s) (TP=1)" in done.stdout, done.stdout[-2000:]
    report = json.loads((tmp_path / "default" / "report.json").read_text())
    assert report["status"] == "completed"
    engines = report["config"]["engines"]
    launched = (engines["kind"], engines["device"], engines["sglang_python"], engines["urls"])
    assert launched == ("sglang", "auto", None, []), launched
    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    versions = [report["baseline"]["version"], *(r["version"] for r in rounds)]
    for r, earlier in zip(rounds, versions):
        assert set(r["tokens_by_version"]) <= {earlier, r["version"]} and r["samples_tagged"], r
        assert r["tokens_by_version"].get(earlier, 0) > 0, r["tokens_by_version"]
    for r in rounds:
        assert r["synced"] and r["committed"] and r["verified"], r
        assert r["verification"] == "engine-exact (sha256)" and r["num_tensors"] == 25, r
        assert len(r["engines"]) == 2 and all(u.startswith("http://127.0.0.1:") for u in r["engines"])
        assert r["prefix_cache"] == dict.fromkeys(r["engines"], "flushed with the updates"), r["prefix_cache"]
        assert all("flush" not in calls for calls in r["engine_calls"].values()), r["engine_calls"]
    assert report["baseline"]["logprob_diff_max"] <= LOGPROB_BOUND, report["baseline"]
    for r in rounds:  # rollouts that ended before the sync have no token of its version to compare
        if r["tokens_by_version"].get(r["version"], 0):
            assert r["logprob_diff_max"] is not None and r["logprob_diff_max"] <= LOGPROB_BOUND, r
        else:
            assert r["logprob_diff_max"] is None, r
    print("\n[job] tokens by version per round:", [r["tokens_by_version"] for r in rounds])
