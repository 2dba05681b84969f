"""Start or join the Ray cluster a run uses; a local one binds its processes to loopback (127.0.0.1) only."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from miles_sync.config import ClusterConfig
from miles_sync.env import LOOPBACK_HOST

__all__ = ["RayConnection", "connect_ray", "prepare_environment"]

# Ray's own variable: set by `ray job submit` for the entry point, and by users who `ray start` a cluster.
_RAY_ADDRESS = "RAY_ADDRESS"
_LOCAL_OBJECT_STORE_BYTES = 256 * 2**20  # a local run moves small models; Ray's default takes 30% of RAM


@dataclass(frozen=True, kw_only=True)
class RayConnection:
    address: str  # the GCS address
    is_local: bool  # True: this process started the cluster and stops it on exit


def _address(cluster: ClusterConfig) -> str | None:
    return cluster.address if cluster.address is not None else os.environ.get(_RAY_ADDRESS) or None


def prepare_environment(cluster: ClusterConfig) -> None:
    """Call before `ray` is first imported. For a local cluster: keep Ray's processes on 127.0.0.1 (without
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read at import, Ray binds the machine's non-loopback address even with a
    loopback node IP) and keep its token file out of the user's home. A multi-node cluster is never touched here:
    its nodes were started by `ray start` with their own addresses (a cluster simulated on loopback addresses needs
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 on its nodes instead, or workers refuse to join: tests/ray/multinode.py)."""
    if _address(cluster) is None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@contextlib.contextmanager
def connect_ray(cluster: ClusterConfig) -> Iterator[RayConnection]:
    """Join `cluster.address` (or the cluster RAY_ADDRESS names, as inside a `ray job submit` entry point), else
    start a local cluster bound to 127.0.0.1; disconnects (and stops a local cluster) on exit. Call
    `prepare_environment` before importing ray."""
    import ray

    address = _address(cluster)
    if ray.is_initialized():  # embedded in a driver that connected already
        yield RayConnection(address=ray.get_runtime_context().gcs_address, is_local=False)
        return
    if address is None:
        prepare_environment(cluster)
        ray.init(
            address="local",
            num_cpus=cluster.num_cpus,
            include_dashboard=False,
            _node_ip_address=LOOPBACK_HOST,
            object_store_memory=_LOCAL_OBJECT_STORE_BYTES,
            log_to_driver=False,
        )
    else:
        if cluster.num_cpus is not None:
            raise ValueError(f"cluster.num_cpus={cluster.num_cpus} applies to a local cluster only; joining {address}")
        ray.init(address=address, log_to_driver=False)
    try:
        yield RayConnection(address=ray.get_runtime_context().gcs_address, is_local=address is None)
    finally:
        ray.shutdown()
