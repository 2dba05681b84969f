"""The update groups one engine has joined, by name (SGLang keys groups by `group_name`).

Joining blocks until the rendezvous completes, so it runs outside every engine lock: the engine keeps serving
while a trainer's ranks gather. A name is reserved while its rendezvous is in progress, so two concurrent joins
under one name cannot both succeed. Joins run one at a time, as in SGLang, whose scheduler handles one
`init_weights_update_group` at a time and blocks in its rendezvous: a controller that asked two engines to join
two groups in opposite orders would deadlock both here as it would there (until the rendezvous timeout).
"""

from __future__ import annotations

import threading

from miles_sync.transport.group import UpdateGroup, create_update_group

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine


class UpdateGroups:
    """Thread-safe registry of joined groups; `close` destroys them all."""

    def __init__(self, *, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._groups: dict[str, UpdateGroup | None] = {}  # None: a rendezvous in progress under that name
        self._lock = threading.Lock()
        self._rendezvous = threading.Lock()  # one join at a time (module docstring)

    def join(
        self, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str
    ) -> UpdateGroup:
        """Create and register the group; raises ValueError for a taken name or a failed rendezvous."""
        with self._lock:
            if group_name in self._groups:
                raise ValueError(f"update group {group_name!r} already exists; destroy it first")
            self._groups[group_name] = None
        group = None
        try:
            with self._rendezvous:
                group = create_update_group(
                    master_address=master_address,
                    master_port=master_port,
                    rank=rank,
                    world_size=world_size,
                    group_name=group_name,
                    backend=backend,
                    timeout_s=self._timeout_s,
                )
        except (ValueError, TimeoutError, RuntimeError) as exc:
            raise ValueError(f"joining update group {group_name!r} failed: {exc}") from None
        finally:
            with self._lock:
                if group is None:
                    del self._groups[group_name]
                else:
                    self._groups[group_name] = group
        return group

    def get(self, group_name: str) -> UpdateGroup:
        """The usable group of that name; ValueError naming the known groups otherwise."""
        with self._lock:
            group = self._groups.get(group_name)
            if group is None:
                raise ValueError(f"no update group named {group_name!r}; groups: {self._names()}")
        if not group.is_usable:
            raise ValueError(
                f"update group {group_name!r} is unusable after a failed collective; destroy and re-create it"
            )
        return group

    def destroy(self, group_name: str) -> None:
        with self._lock:
            group = self._groups.get(group_name)
            if group is None:
                raise ValueError(f"no update group named {group_name!r}; groups: {self._names()}")
            del self._groups[group_name]
        group.destroy()

    def close(self) -> None:
        with self._lock:
            groups = [g for g in self._groups.values() if g is not None]
            self._groups.clear()
        for group in groups:
            group.destroy()

    def _names(self) -> list[str]:
        return sorted(name for name, group in self._groups.items() if group is not None)
