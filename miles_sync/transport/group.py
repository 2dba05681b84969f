"""The weight-update process group: one torch.distributed group per trainer/engine fleet, built from a TCP store.

The group never touches torch.distributed's default group or its registry: the process group object is built
directly on a `TCPStore` behind the prefixes SGLang's `init_custom_process_group` uses
(`<group_name>` / `<group_name>/` / `<device>/`), so a trainer and engines using either helper meet in the same
store, and a Megatron process that already has a default group can join a second, unrelated one. The trainer's
source rank is rank 0 and usually hosts the store (`start_store_server`, port chosen by the OS); every other rank
connects with the group's world size, as torch's tcp:// rendezvous does, so it also meets a master that waits for
its workers (an SGLang-style trainer's).

Every blocking step has a timeout: store connection, rendezvous at creation, and each collective (`work.wait`).
After a timed-out or failed collective the group is unusable (peers may be mid-collective): every later call raises,
and the owner destroys it and creates a new one.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from miles_sync.env import LOOPBACK_HOST, configured_host, is_loopback, is_wildcard
from miles_sync.wire.text import raise_if

__all__ = ["UpdateGroup", "create_update_group", "start_store_server"]

_BACKENDS = ("gloo", "nccl")


def start_store_server(*, host: str, port: int = 0, timeout_s: float) -> dist.TCPStore:
    """Start the group's rendezvous store on `host`:`port` (0: the OS picks; read it back from `.port`).

    TCPStore given a host name still listens on every interface, so the listening socket is bound here, on `host`
    only, and handed over to the store. Returns at once; pass the store to `create_update_group(store=...)` on the
    rank that hosts it.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)
        bound_port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    # From here on the store owns the descriptor (and closes it with the store).
    return dist.TCPStore(
        host,
        bound_port,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


class UpdateGroup:
    """A process group of `world_size` ranks for broadcasting weights; this process is `rank`.

    Safe to use from one thread at a time; collectives must be issued in the same order on every rank.
    """

    def __init__(
        self,
        *,
        process_group: dist.ProcessGroup,
        store: dist.Store,
        group_name: str,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
    ) -> None:
        self._process_group = process_group
        self._store = store  # kept alive for the group's lifetime: the store server may live in this process
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self._broken: str | None = None
        self._lock = threading.Lock()

    @property
    def is_usable(self) -> bool:
        return self._broken is None and self._process_group is not None

    def broadcast(self, tensor: torch.Tensor, *, src: int, timeout_s: float) -> None:
        """Broadcast `tensor` in place from rank `src`; waits at most `timeout_s` seconds.

        `tensor` must be contiguous and live on `self.device` (gloo sends wrong bytes for non-contiguous tensors);
        any dtype works, the bytes travel as they are.
        Raises TimeoutError or RuntimeError; after either the group is unusable.
        """
        self.check_broadcastable(tensor, src=src)
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        # The backend's own deadline: without it a timed-out wait leaves the collective pending in the backend's
        # worker until the group's default timeout, and destroy() would wait for it.
        options.timeout = timedelta(seconds=timeout_s)
        # A broadcast moves bytes: sending the uint8 view works for every dtype (gloo has no float8 kernels) and
        # meets a peer that sends the typed tensor of the same byte size.
        raw = tensor.reshape(-1).view(torch.uint8)
        self._run(lambda pg: pg.broadcast([raw], options), what=f"broadcast from rank {src}", timeout_s=timeout_s)

    def check_broadcastable(self, tensor: torch.Tensor, *, src: int) -> None:
        """Raise ValueError when `broadcast(tensor, src=src)` would refuse it. Pure; callers that announce a
        broadcast to its receivers first (over HTTP) check here before announcing it."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"src {src} is outside group {self.group_name!r} of size {self.world_size}")
        if not tensor.is_contiguous():
            raise ValueError(f"broadcast needs a contiguous tensor; got strides {tensor.stride()}")
        if tensor.device != self.device:
            raise ValueError(f"group {self.group_name!r} broadcasts on {self.device}, tensor is on {tensor.device}")

    def exchange(
        self,
        *,
        sends: Mapping[int, Sequence[torch.Tensor]] | None = None,
        recvs: Mapping[int, Sequence[torch.Tensor]] | None = None,
        timeout_s: float,
    ) -> None:
        """Point to point: send `sends[p]` to rank p and receive `recvs[p]` from rank p, each list in order, every
        transfer posted at once (two ranks may send to each other); returns when all are done, within `timeout_s`
        in all. Each tensor travels as its bytes: sender and receiver give the same byte sizes in the same order.
        Raises ValueError for a bad peer or tensor, TimeoutError or RuntimeError when a transfer fails; after
        either the group is unusable."""
        sends, recvs = dict(sends or {}), dict(recvs or {})
        problems = [
            f"rank {p} is not a peer of rank {self.rank} in a group of {self.world_size}"
            for p in {*sends, *recvs}
            if not 0 <= p < self.world_size or p == self.rank
        ]
        problems += [
            f"tensor {i} for rank {p}: {why}"
            for p, tensors in (*sends.items(), *recvs.items())
            for i, t in enumerate(tensors)
            for why in (
                "is not contiguous" if not t.is_contiguous() else None,
                f"is on {t.device}, the group on {self.device}" if t.device != self.device else None,
            )
            if why is not None
        ]
        raise_if(problems, what=f"cannot exchange in update group {self.group_name!r}")

        def issue(pg: dist.ProcessGroup) -> list:
            raw = {
                kind: {p: [t.reshape(-1).view(torch.uint8) for t in ts] for p, ts in given.items()}
                for kind, given in (("send", sends), ("recv", recvs))
            }
            works = [pg.send([t], p, tag) for p, ts in raw["send"].items() for tag, t in enumerate(ts)]
            return works + [pg.recv([t], p, tag) for p, ts in raw["recv"].items() for tag, t in enumerate(ts)]

        peers = sorted({*sends, *recvs})
        self._run(issue, what=f"exchange with ranks {peers}", timeout_s=timeout_s)

    def barrier(self, *, timeout_s: float) -> None:
        """Wait until every rank reached the barrier, at most `timeout_s` seconds."""
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        options = dist.AllreduceOptions()
        options.timeout = timedelta(seconds=timeout_s)
        self._run(lambda pg: pg.allreduce([flag], options), what="barrier", timeout_s=timeout_s)

    def destroy(self) -> None:
        """Release the process group and the store connection. Idempotent; later calls on the group raise.

        Waits for a collective in flight on another thread, at most that collective's timeout.
        """
        with self._lock:
            process_group, self._process_group = self._process_group, None
            self._store = None
        if process_group is None:
            return
        try:
            process_group.shutdown()
        except RuntimeError:
            pass  # a group broken by a peer may refuse a clean shutdown; dropping it is enough

    def _run(self, issue, *, what: str, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        with self._lock:
            if self._process_group is None:
                raise RuntimeError(f"update group {self.group_name!r} was destroyed")
            if self._broken is not None:
                raise RuntimeError(f"update group {self.group_name!r} is unusable after: {self._broken}")
            work = None
            try:
                work = issue(self._process_group)
                completed = _wait_all(work if isinstance(work, list) else [work], timeout_s=timeout_s)
            except RuntimeError as exc:
                self._broken = f"{what} failed: {exc}"
                if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                    raise TimeoutError(f"{what} in group {self.group_name!r} timed out after {timeout_s} s") from exc
                raise
            finally:
                # A failed collective's Work keeps gloo's connections open (they close only with the last reference
                # to it): a traceback holding this frame would keep a peer blocked in its receive after destroy(),
                # and an SGLang engine has no collective timeout to end that receive. Measured on torch 2.13: a
                # receiver whose root's broadcast failed stayed blocked while the Work lived, and was released
                # within 0.1 s of destroy() once it did not.
                del work
            if completed is False:
                self._broken = f"{what} timed out"
                raise TimeoutError(f"{what} in group {self.group_name!r} timed out after {timeout_s} s")
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()


def _wait_all(works: list, *, timeout_s: float) -> bool:
    """Wait for every work within `timeout_s` in all; False when one did not complete in time."""
    deadline = time.monotonic() + timeout_s
    for work in works:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or work.wait(timedelta(seconds=remaining)) is False:
            return False
    return True


def create_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    store: dist.TCPStore | None = None,
    local_address: str | None = None,
) -> UpdateGroup:
    """Join (rank 0 with `store`: host) the group; blocks until all `world_size` ranks joined or `timeout_s` passed.

    `store`: the `start_store_server` store (or any master `TCPStore`) when this rank hosts it; other ranks connect
    to `master_address`:`master_port` and register as one of the store's `world_size` users, so a master built
    elsewhere with `world_size` and `wait_for_workers=True` (SGLang-style trainers) counts them. `local_address`:
    the address this rank's gloo transport binds; by default this process's configured address (MILES_SYNC_HOST,
    which an actor shell sets to its node's), else 127.0.0.1 when the master is on loopback, else gloo's own
    choice (GLOO_SOCKET_IFNAME). The timeout also becomes the default for the group's collectives. Raises
    ValueError for bad arguments, TimeoutError when the rendezvous does not complete in time.
    """
    problems = []
    if backend not in _BACKENDS:
        problems.append(f"backend {backend!r} is not one of {list(_BACKENDS)}")
    if world_size < 1:
        problems.append(f"world_size {world_size} must be >= 1")
    if not 0 <= rank < max(world_size, 1):
        problems.append(f"rank {rank} is outside [0, {world_size})")
    if store is None and not 0 < master_port < 2**16:
        problems.append(f"master_port {master_port} is not a TCP port")
    if not group_name:
        problems.append("group_name is empty")
    if timeout_s <= 0:
        problems.append(f"timeout_s {timeout_s} must be > 0")
    if backend == "nccl" and not torch.cuda.is_available():
        problems.append("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
    raise_if(problems, what="cannot create update group")

    timeout = timedelta(seconds=timeout_s)
    try:
        if store is None:
            # With the world size the client registers itself with the master, as torch's tcp:// rendezvous (and so
            # SGLang's `init_custom_process_group`) does on every rank; a master built with `wait_for_workers=True`
            # waits for exactly those registrations. Without it the client never counts and such a master times out.
            store = dist.TCPStore(master_address, master_port, world_size=world_size, is_master=False, timeout=timeout)
        device_type = "cuda" if backend == "nccl" else "cpu"
        prefixed = dist.PrefixStore(group_name, store)
        prefixed = dist.PrefixStore(f"{device_type}/", dist.PrefixStore(f"{group_name}/", prefixed))
        if backend == "gloo":
            process_group, device = _gloo(prefixed, rank, world_size, timeout, master_address, local_address)
        else:
            process_group, device = _nccl(prefixed, rank, world_size, timeout)
    except (RuntimeError, dist.DistStoreError) as exc:
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            raise TimeoutError(
                f"update group {group_name!r} (rank {rank} of {world_size}) did not rendezvous at "
                f"{master_address}:{master_port} within {timeout_s} s"
            ) from exc
        raise
    return UpdateGroup(
        process_group=process_group,
        store=store,
        group_name=group_name,
        rank=rank,
        world_size=world_size,
        backend=backend,
        device=device,
    )


def gloo_device(*, local_address: str | None = None, master_address: str | None = None):
    """The gloo device a group of miles_sync binds: `local_address`, else this process's configured address
    (MILES_SYNC_HOST: its node's, adopted by the actor shell), else 127.0.0.1 when `master_address` is on loopback,
    else gloo's own choice (the interface GLOO_SOCKET_IFNAME names, miles_sync.env)."""
    if local_address is None:
        local_address = configured_host()
    if local_address is None and master_address is not None and is_loopback(master_address):
        local_address = LOOPBACK_HOST
    if local_address is None or is_wildcard(local_address):  # a wildcard is no address peers can connect to
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=local_address)


def _gloo(store, rank, world_size, timeout, master_address, local_address):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [gloo_device(local_address=local_address, master_address=master_address)]
    return dist.ProcessGroupGloo(store, rank, world_size, options), torch.device("cpu")


def _nccl(store, rank, world_size, timeout):
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    device = torch.device("cuda", torch.cuda.current_device())
    return dist.ProcessGroupNCCL(store, rank, world_size, options), device
