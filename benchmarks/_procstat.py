"""Per-process figures read from /proc (Linux): resident memory, open descriptors, threads, child processes.

The benchmarks and the soak need only these few numbers, so they read them straight from procfs instead of adding
a dependency for it. `PeakSampler` polls a set of processes on a thread and keeps each one's highest RSS.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

__all__ = ["PeakSampler", "child_pids", "num_fds", "num_threads", "rss_bytes"]


def _status_field(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"/proc/{pid}/status has no {field}")


def rss_bytes(pid: int) -> int:
    return _status_field(pid, "VmRSS") * 1024


def num_threads(pid: int) -> int:
    return _status_field(pid, "Threads")


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's children file, deduplicated)."""
    children: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children.update(int(c) for c in f.read().split())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return sorted(children)


class PeakSampler:
    """Highest RSS of each pid between `start()` and `stop()`, polled every `interval_s` on a daemon thread."""

    def __init__(self, pids: Iterable[int], *, interval_s: float = 0.005) -> None:
        self._pids = tuple(pids)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.baseline = {pid: rss_bytes(pid) for pid in self._pids}
        self.peak = dict(self.baseline)

    def start(self) -> PeakSampler:
        self.baseline = {pid: rss_bytes(pid) for pid in self._pids}
        self.peak = dict(self.baseline)
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[int, int]:
        """Stop polling; returns each pid's peak RSS growth over its baseline, in bytes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._sample()
        return {pid: self.peak[pid] - self.baseline[pid] for pid in self._pids}

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> None:
        for pid in self._pids:
            try:
                self.peak[pid] = max(self.peak[pid], rss_bytes(pid))
            except (FileNotFoundError, ProcessLookupError):
                continue
