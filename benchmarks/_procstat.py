"""Per-process figures read from /proc (Linux): resident memory, open descriptors, threads, child processes.

The benchmarks and the soak need only these few numbers, so they read them straight from procfs instead of adding
a dependency for it. `PeakSampler` polls a set of processes on a thread and keeps each one's highest RSS;
`FleetProbe` samples a fleet's processes and attributes /dev/shm entries to it (the soak).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "FleetProbe",
    "PeakSampler",
    "ProcessSample",
    "child_pids",
    "command_name",
    "cpu_seconds",
    "num_fds",
    "num_threads",
    "rss_bytes",
    "sample_process",
    "shm_entries",
]


def _status_field(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"/proc/{pid}/status has no {field}")


def rss_bytes(pid: int) -> int:
    return _status_field(pid, "VmRSS") * 1024


def peak_rss_bytes(pid: int) -> int:
    """The kernel's high-water mark of the process's RSS (VmHWM): exact, unlike any polling."""
    return _status_field(pid, "VmHWM") * 1024


def reset_peak_rss(pid: int) -> bool:
    """Set the process's RSS high-water mark back to its current RSS (writing 5 to /proc/<pid>/clear_refs, Linux
    4.0+); False where the kernel or the process's owner does not allow it."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def num_threads(pid: int) -> int:
    return _status_field(pid, "Threads")


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time `pid` has used so far (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime and stime: fields 14 and 15 of stat(5)


def machine_busy_seconds() -> float:
    """CPU seconds every core of this machine has spent busy so far (user, nice, system, irq, softirq, steal), from
    /proc/stat: over a sync on an otherwise quiet machine, what every process of it used together."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS


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
    """Highest RSS of each pid between `start()` and `stop()`: the kernel's high-water mark, reset at `start()`
    (`reset_peak_rss`; exact, however short the peak), and where that cannot be reset, RSS polled every
    `interval_s` on a daemon thread (which misses a peak shorter than the poll gap, or one that falls while this
    process's GIL is busy: the sending process is this one)."""

    def __init__(self, pids: Iterable[int], *, interval_s: float = 0.005) -> None:
        self._pids = tuple(pids)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exact: set[int] = set()
        self.baseline = {pid: rss_bytes(pid) for pid in self._pids}
        self.peak = dict(self.baseline)

    def start(self) -> PeakSampler:
        self.baseline = {pid: rss_bytes(pid) for pid in self._pids}
        self.peak = dict(self.baseline)
        self._exact = {pid for pid in self._pids if reset_peak_rss(pid)}
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[int, int]:
        """Stop polling; returns each pid's peak RSS growth over its baseline, in bytes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._sample()
        for pid in self._exact:
            try:
                self.peak[pid] = max(self.peak[pid], peak_rss_bytes(pid))
            except (FileNotFoundError, ProcessLookupError):
                continue
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


# ---- a fleet of processes and its shared memory (benchmarks/soak.py) ---------------------------------------------

SHM_DIR = Path("/dev/shm")
_TORCH_SEGMENT = re.compile(r"^torch_(\d+)_")  # torch's file_system strategy embeds the creator's pid


@dataclass(frozen=True, kw_only=True)
class ProcessSample:
    rss_bytes: int
    num_fds: int
    num_threads: int


def sample_process(pid: int) -> ProcessSample | None:
    """None when the process is gone (or a zombie: it holds no memory or fds any more)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rpartition(")")[2].split()[0] == "Z":
                return None
        return ProcessSample(rss_bytes=rss_bytes(pid), num_fds=num_fds(pid), num_threads=num_threads(pid))
    except (FileNotFoundError, ProcessLookupError, KeyError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...); ones that exit meanwhile are skipped."""
    found, pending = [], [pid]
    while pending:
        try:
            children = child_pids(pending.pop())
        except FileNotFoundError:
            continue
        found += children
        pending += children
    return found


def command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return "?"


def _shm_held_by(pid: int) -> set[str]:
    """/dev/shm entries process `pid` maps or has open (best effort: the process may end meanwhile)."""
    held = set()
    prefix = str(SHM_DIR) + "/"
    with contextlib.suppress(FileNotFoundError, PermissionError, ProcessLookupError):
        with open(f"/proc/{pid}/maps") as maps:
            held.update(line.split(prefix, 1)[1].split()[0] for line in maps if prefix in line)
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    held.add(target[len(prefix) :].split()[0])
    return held


def shm_entries() -> set[str]:
    return set(os.listdir(SHM_DIR))


class FleetProbe:
    """Samples the fleet's named processes and their descendants, and attributes /dev/shm entries to this run.

    An entry counts as this run's when it did not exist before the run and a process of the run (any descendant of
    the driver: Ray's own processes included) was seen holding it, or its torch name embeds such a pid. Entries of
    other users of the machine are thereby left out."""

    def __init__(self, roots: dict[str, int], *, shm_before: set[str]) -> None:
        self._roots = roots
        self._shm_before = shm_before
        self._run_pids: set[int] = {os.getpid()}
        self._run_shm: set[str] = set()
        self.labels: dict[int, str] = {}

    def sample(self) -> tuple[dict[int, ProcessSample], set[str]]:
        """Figures of every fleet process alive now (pid -> sample), and this run's /dev/shm entries present now."""
        named = set(self._roots.values())
        for role, pid in self._roots.items():
            self.labels.setdefault(pid, role)
            if role == "driver":  # the driver's children are Ray's own processes, not the fleet's
                continue
            for child in descendants(pid):
                if child not in named:
                    self.labels.setdefault(child, f"{role}/{command_name(child)}")
        figures = {pid: s for pid in self.labels if (s := sample_process(pid)) is not None}
        self._run_pids.update(descendants(os.getpid()))
        for pid in self._run_pids:
            self._run_shm |= _shm_held_by(pid) - self._shm_before
        present = shm_entries() - self._shm_before
        self._run_shm |= {n for n in present if (m := _TORCH_SEGMENT.match(n)) and int(m.group(1)) in self._run_pids}
        return figures, present & self._run_shm

    @property
    def run_pids(self) -> set[int]:
        return set(self._run_pids)

    @property
    def run_shm(self) -> set[str]:
        return set(self._run_shm)
