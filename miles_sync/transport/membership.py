"""The update group's membership as pure records: the controller owns it (ranks, world size, address), the
distributed transport executes it. The trainer source is rank 0; engine i's TP rank r is rank_offset_i + r, offsets
packed in engine order after the source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from miles_sync.weights.shard_plan import DirectLayout
from miles_sync.wire.protocol import InitWeightsUpdateGroupRequest
from miles_sync.wire.text import raise_if

__all__ = ["EngineEndpoint", "GroupMembership", "plan_membership"]


@dataclass(frozen=True, kw_only=True)
class EngineEndpoint:
    """An engine as the controller tells the source about it: where it listens, how many TP ranks it runs and, for
    a transport that sends the engine's own parameters (`TransportSpec.needs_engine_layouts`), their layout."""

    url: str
    tp_size: int
    direct: DirectLayout | None = None


@dataclass(frozen=True, kw_only=True)
class EngineRanks:
    url: str
    rank_offset: int
    tp_size: int


@dataclass(frozen=True, kw_only=True)
class GroupMembership:
    """Who is in the update group and where it meets. `master_port` 0: the source rank lets the OS pick a port
    when it starts the store, and reports it back in the membership it returns from `Transport.open`.
    `master_address` None: the source rank's own bind address (its node's, miles_sync.env.bind_host), filled in
    the same way; so with pipeline stages each stage's group meets on its own source rank's node."""

    group_name: str
    backend: str
    master_address: str | None
    master_port: int
    world_size: int
    engines: tuple[EngineRanks, ...]

    source_rank: int = 0

    def bound_to(self, *, address: str, port: int) -> GroupMembership:
        """The membership as the source rank started its store: at `address`:`port`."""
        return replace(self, master_address=address, master_port=port)

    def init_request(self, url: str) -> InitWeightsUpdateGroupRequest:
        """The /init_weights_update_group body for the engine at `url` (needs the bound address and port)."""
        if self.master_address is None:
            raise ValueError(f"update group {self.group_name!r} has no master address yet (the source binds it)")
        for engine in self.engines:
            if engine.url == url:
                return InitWeightsUpdateGroupRequest(
                    master_address=self.master_address,
                    master_port=self.master_port,
                    rank_offset=engine.rank_offset,
                    world_size=self.world_size,
                    group_name=self.group_name,
                    backend=self.backend,
                )
        raise ValueError(f"engine {url} is not a member of update group {self.group_name!r}")


def plan_membership(
    *,
    engines: Sequence[EngineEndpoint],
    group_name: str,
    backend: str,
    master_address: str | None,
    master_port: int = 0,
) -> GroupMembership:
    """Ranks for the source (0) and each engine, in the given order. Pure. `master_address` None: the source
    rank binds its own address when it opens the group.

    Raises ValueError naming every duplicate URL and every non-positive tp_size.
    """
    problems = []
    urls = [e.url for e in engines]
    duplicates = sorted({u for u in urls if urls.count(u) > 1})
    if duplicates:
        problems.append(f"duplicate engine URLs {duplicates}")
    bad_tp = [f"{e.url} tp_size={e.tp_size}" for e in engines if e.tp_size < 1]
    if bad_tp:
        problems.append(f"tp_size must be >= 1: {', '.join(bad_tp)}")
    if not engines:
        problems.append("an update group needs at least one engine")
    if not 0 <= master_port < 2**16:
        problems.append(f"master_port={master_port} is not 0 (OS-chosen) or a TCP port")
    raise_if(problems, what=f"cannot plan update group {group_name!r}")
    ranks = []
    offset = 1  # rank 0 is the trainer source
    for engine in engines:
        ranks.append(EngineRanks(url=engine.url, rank_offset=offset, tp_size=engine.tp_size))
        offset += engine.tp_size
    return GroupMembership(
        group_name=group_name,
        backend=backend,
        master_address=master_address,
        master_port=master_port,
        world_size=offset,
        engines=tuple(ranks),
    )
