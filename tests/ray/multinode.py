"""A simulated three-node Ray cluster on one host, and an audit of the TCP listeners of its processes.

Every node gets its own loopback-range address (all of 127.0.0.0/8 is loopback on Linux, and a socket bound to
127.0.0.3 refuses connections addressed to 127.0.0.4), so an address that leaks from one node to another fails
here as it would across machines, while nothing leaves loopback:

    head    127.0.0.2   custom resources node_a                 (dashboard on 127.0.0.2, for `ray job submit`)
    worker  127.0.0.3   custom resources node_b, worker_node
    worker  127.0.0.4   custom resources node_c, worker_node

Ray's own listeners in an actor's process (its core worker's gRPC server, on every interface) use the node's worker
port range, set per node here (`ray_ports`), so an audit can tell them from the sockets miles_sync opens.

RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 is set for the `ray start` processes of this cluster only (their environment,
never this process's): on this Ray version a worker refuses to join a head on a loopback address without it. The
rest of the suite keeps it at 0 (tests/conftest.py), which is what holds a single-node local cluster on 127.0.0.1.

Each node is one `ray start --block` process in a session of its own; stopping sends it SIGTERM (it stops the
node's processes) and then kills whatever is left in those sessions. `ray stop` is never used: it stops every Ray
process on the host, other clusters included.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import ray

HEAD_IP = "127.0.0.2"
WORKER_IPS = ("127.0.0.3", "127.0.0.4")
NODE_RESOURCES = {
    "127.0.0.2": {"node_a": 100},
    "127.0.0.3": {"node_b": 100, "worker_node": 100},
    "127.0.0.4": {"node_c": 100, "worker_node": 100},
}
# Each node's Ray worker ports, below the OS's ephemeral range (where ports miles_sync binds to 0 come from).
_WORKER_PORTS = {"127.0.0.2": (21000, 21199), "127.0.0.3": (21200, 21399), "127.0.0.4": (21400, 21599)}
_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 30.0
# Every port a node would otherwise take at a fixed default (two nodes on one host would collide) is chosen here.
_PORT_FLAGS = (
    "--node-manager-port",
    "--object-manager-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
    "--dashboard-agent-grpc-port",
    "--dashboard-agent-listen-port",
)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    gcs_address: str  # host:port, what `ray.init(address=...)` and RAY_ADDRESS take
    dashboard_url: str  # what `ray job submit --address` takes
    node_ips: tuple[str, ...]  # head first
    env: dict[str, str]  # the environment the nodes run with (for `ray job submit`)


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ray_cli() -> str:
    return str(Path(sys.executable).parent / "ray")


def _node_env() -> dict[str, str]:
    env = {
        **os.environ,
        # Only this cluster's nodes: a worker joins a head on a loopback address only with this set to 1.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    }
    for variable in ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MILES_SYNC_HOST"):
        env.pop(variable, None)  # each actor derives its own from its node (actors.node)
    return env


def ray_ports(port: int) -> bool:
    """Whether `port` is in a Ray worker port range of this cluster (Ray's core worker listens there)."""
    return any(low <= port <= high for low, high in _WORKER_PORTS.values())


def _start_node(args: Sequence[str], *, ip: str, env: dict[str, str], log_dir: Path) -> subprocess.Popen:
    """One node, with a temp dir of its own: nodes sharing one would share (and garbage-collect) each other's
    runtime-env files, e.g. a submitted job's working directory."""
    temp_dir = log_dir / ip.rsplit(".", 1)[1]
    ports = [f"--temp-dir={temp_dir}", *(arg for flag in _PORT_FLAGS for arg in (flag, str(free_port(ip))))]
    low, high = _WORKER_PORTS[ip]
    ports += [f"--min-worker-port={low}", f"--max-worker-port={high}", f"--resources={json.dumps(NODE_RESOURCES[ip])}"]
    command = [_ray_cli(), "start", "--block", f"--node-ip-address={ip}", "--disable-usage-stats", *ports, *args]
    log = open(log_dir / f"node-{ip}.log", "w")  # noqa: SIM115 - closed with the process, by the OS
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _alive_nodes() -> set[str]:
    return {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def _wait_for(predicate, *, what: str, processes: Sequence[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        dead = [p.args[-1] for p in processes if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s} s (exited: {dead})")
        time.sleep(0.2)


@contextlib.contextmanager
def three_node_cluster(*, num_cpus: int = 1) -> Iterator[Cluster]:
    """Start the cluster (module docstring), connect this process to it as a driver on the head's address, and on
    exit disconnect and stop exactly the processes it started. The nodes start one after another: nodes starting
    together on one host race for the same free ports."""
    env = _node_env()
    temp_dir = Path(tempfile.mkdtemp(prefix="msn-", dir="/tmp"))  # Ray's socket paths must stay short
    gcs_port, dashboard_port = free_port(HEAD_IP), free_port(HEAD_IP)
    gcs_address = f"{HEAD_IP}:{gcs_port}"
    common = [f"--num-cpus={num_cpus}", "--object-store-memory=80000000"]
    processes: list[subprocess.Popen] = []
    try:
        processes.append(
            _start_node(
                [
                    "--head",
                    f"--port={gcs_port}",
                    f"--ray-client-server-port={free_port(HEAD_IP)}",
                    "--include-dashboard=true",
                    f"--dashboard-host={HEAD_IP}",
                    f"--dashboard-port={dashboard_port}",
                    *common,
                ],
                ip=HEAD_IP,
                env=env,
                log_dir=temp_dir,
            )
        )
        _wait_for(lambda: _accepts(HEAD_IP, gcs_port), what="head GCS", processes=processes, timeout_s=60)
        ray.init(address=gcs_address, _node_ip_address=HEAD_IP, log_to_driver=False)
        try:
            for ip in WORKER_IPS:
                processes.append(
                    _start_node(
                        [f"--address={gcs_address}", *common],
                        ip=ip,
                        env=env,
                        log_dir=temp_dir,
                    )
                )
                _wait_for(
                    lambda ip=ip: ip in _alive_nodes(),
                    what=f"node {ip}",
                    processes=processes,
                    timeout_s=_START_TIMEOUT_S,
                )
            yield Cluster(
                gcs_address=gcs_address,
                dashboard_url=f"http://{HEAD_IP}:{dashboard_port}",
                node_ips=(HEAD_IP, *WORKER_IPS),
                env=env,
            )
        finally:
            ray.shutdown()
    finally:
        _stop(processes)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def _stop(processes: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each node's `ray start --block` (workers first), then SIGKILL anything left in their sessions."""
    for process in reversed(processes):
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    for process in reversed(processes):
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(_STOP_TIMEOUT_S)
    sessions = {p.pid for p in processes}
    for pid in _pids_in_sessions(sessions):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _pids_in_sessions(sessions: set[int]) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # after "pid (comm)": state ppid pgrp session ...
        if int(fields[3]) in sessions:
            pids.append(int(entry.name))
    return pids


# ---- listeners ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Listener:
    pid: int
    address: str
    port: int

    @property
    def is_wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified


def children_of(pid: int) -> list[int]:
    """Every descendant of `pid` (by parent pid), at this moment."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def listeners(pids: Iterable[int]) -> list[Listener]:
    """The listening TCP sockets (IPv4 and IPv6) that processes `pids` hold, from /proc (no extra tools)."""
    inodes: dict[int, int] = {}
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes[int(target[8:-1])] = pid
    found = []
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with contextlib.suppress(OSError), open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                hex_address, hex_port = local.split(":")
                raw = bytes.fromhex(hex_address)
                # /proc prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
                address = ipaddress.ip_address(raw)
                mapped = getattr(address, "ipv4_mapped", None)
                found.append(Listener(pid=inodes[inode], address=str(mapped or address), port=int(hex_port, 16)))
    return sorted(found)
