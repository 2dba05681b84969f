"""The soak's leak judgement on real processes: benchmarks/soak.py's probe (benchmarks/_procstat.FleetProbe)
samples two live child processes after each step, one that keeps what each step gives it (8 MiB of touched memory
and a /dev/shm file held open by an fd) and one that gives it back, and the verdict built from those samples
(`process_figures` -> `failures`) names the one that leaks, for each resource, and never the one that does not.

The end-to-end soak (tests/ray/test_soak_script.py) runs a fleet that does not leak; this is the case it cannot
show, a fleet that does."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
NUM_STEPS, WARMUP = 5, 1
STEP_TIMEOUT_S = 30.0
# One step: take 8 MiB (touched, so resident) and a /dev/shm file held open; keep them when told to, else let go.
CHILD = r"""
import mmap, os, sys
keep = sys.argv[1] == "keep"
held = []
for line in sys.stdin:
    step = int(line)
    block = mmap.mmap(-1, 8 * 2**20)  # its own mapping: closed, it goes back to the kernel, not to an allocator
    for page in range(0, len(block), mmap.PAGESIZE):  # touched page by page: resident, no temporary copy
        block[page] = 1
    shm = f"/dev/shm/miles_sync_soak_test_{os.getpid()}_{step}"
    fd = os.open(shm, os.O_CREAT | os.O_RDWR)  # held open: the probe attributes the entry to this run
    if keep:
        held.append((block, fd))
    else:
        block.close()
        os.close(fd)
        os.unlink(shm)
    print(step, flush=True)
"""


@pytest.fixture(scope="module")
def soak():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        return importlib.import_module("soak")


def run_steps(soak, children: dict[str, subprocess.Popen]):
    probe = soak.FleetProbe({role: child.pid for role, child in children.items()}, shm_before=soak.shm_entries())
    samples, shm = [], []
    for step in range(1, NUM_STEPS + 1):
        for child in children.values():
            child.stdin.write(f"{step}\n")
            child.stdin.flush()
        for child in children.values():  # each answers once its step is done: sampled after it, not after a sleep
            assert child.stdout.readline().strip() == str(step)
        figures, present = probe.sample()
        samples.append(figures)
        shm.append(present)
    return probe, samples, shm


def record(soak, index: int):
    return soak.SyncRecord(
        index=index,
        version=str(index),
        committed=True,
        verified=True,
        samples_tagged=True,
        num_tensors=1,
        num_changed_tensors=None if index == 1 else 1,
        num_bytes=1,
        train_s=0.0,
        sync_s=0.0,
        rollout_s=0.0,
        error=None,
    )


def test_the_verdict_names_the_process_that_keeps_memory_fds_and_shm_and_only_it(soak, tmp_path):
    children = {
        role: subprocess.Popen(
            [sys.executable, "-c", CHILD, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for role, mode in (("leaky", "keep"), ("steady", "free"))
    }
    try:
        probe, samples, shm = run_steps(soak, children)
        processes = soak.process_figures(probe.labels, samples, warmup=WARMUP, trimmed={})
        reasons = soak.failures(
            processes,
            [record(soak, i) for i in range(1, NUM_STEPS + 1)],
            num_syncs=NUM_STEPS,
            shm_at_warmup=shm[WARMUP - 1],
            shm_at_end=shm[-1],
            shm_leaked=set(),
            survivors=[],
        )
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait(timeout=STEP_TIMEOUT_S)
        for leftover in Path("/dev/shm").glob("miles_sync_soak_test_*"):
            leftover.unlink()
    leaky = f"leaky (pid {children['leaky'].pid})"
    by_role = {p.role: p for p in processes}
    # 4 steps after warm-up keep 32 MiB on a ~10 MiB interpreter, and 4 fds.
    assert by_role["leaky"].rss_growth_pct > 100 and by_role["leaky"].fd_growth == NUM_STEPS - WARMUP
    assert any(r.startswith(leaky) and "grew RSS" in r for r in reasons), reasons
    assert any(r.startswith(leaky) and "more open fds" in r for r in reasons), reasons
    assert any("/dev/shm entries of this run appeared after warm-up" in r for r in reasons), reasons
    assert not [r for r in reasons if r.startswith("steady")], reasons
    assert by_role["steady"].rss_growth_pct < soak.RSS_LIMIT_PCT and by_role["steady"].fd_growth == 0
