"""Where an actor runs: its node's address, adopted inside the actor before it binds anything.

Every actor that opens a listener (engines, trainer ranks) calls `adopt_node_address` first thing in its own
process: the address is `miles_sync.env.bind_host` of the job's explicit `cluster.bind_host` and the Ray node the
actor landed on (127.0.0.1 on a single-node local cluster), and the process adopts it (MILES_SYNC_HOST plus the
gloo/NCCL interface derived from it), so every server, store and process group it or its children create binds
there. miles_sync itself never imports ray: the node IP comes from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from miles_sync.env import adopt_bind_host, bind_host

__all__ = ["NodeAddress", "adopt_node_address", "node_address_of"]


@dataclass(frozen=True, kw_only=True)
class NodeAddress:
    """An actor's node: Ray's node IP and the address the actor binds (equal unless `cluster.bind_host` is set)."""

    node_ip: str
    bind_host: str


def adopt_node_address(override: str | None = None) -> NodeAddress:
    """Runs inside an actor's process: decide its bind address and adopt it (see the module docstring)."""
    node_ip = ray.util.get_node_ip_address()
    host = bind_host(override=override, node_ip=node_ip)
    adopt_bind_host(host)
    return NodeAddress(node_ip=node_ip, bind_host=host)


def _node_address(actor: object) -> NodeAddress:
    return actor.node_address  # type: ignore[attr-defined]


def node_address_of(actor: object, *, timeout_s: float) -> NodeAddress:
    """The NodeAddress a trainer or engine actor of these shells adopted at construction."""
    return ray.get(actor.__ray_call__.remote(_node_address), timeout=timeout_s)  # type: ignore[attr-defined]
