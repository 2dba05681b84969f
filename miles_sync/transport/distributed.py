"""Distributed transport: one broadcast per flattened bucket over the update group, announced over HTTP.

Per bucket: POST `update_weights_from_distributed` (the bucket's names/dtypes/shapes) to every engine first, then
broadcast the bucket's buffer from rank 0, then await every engine's answer. The POSTs are in flight during the
broadcast, because an engine answers only after it received the broadcast. Every step has a timeout, and a failed
POST cannot leave the broadcast hanging: the broadcast has its own timeout, and a broken group is torn down.

Never half-issued: once the engines were told to receive a bucket, its broadcast is issued whatever happens next
(a failed POST, a cancelled send): the buffer is checked before the first POST, and the broadcast is handed to a
thread before the first await, so a receiver is released by the bytes it waits for, then told the session failed.
This matters most on NCCL, where tearing the source's side down does not release a receiver (SGLang's update
group takes no timeout: an abandoned receiver waits out torch's default collective timeout).

Set-up: the source starts the rendezvous store on its own bind address (miles_sync.env.bind_host: its node's, on a
cluster) unless the membership names one, on a port the OS picks, then joins the group in a worker thread
while every engine joins over HTTP, concurrently (each side blocks until all members arrived).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

import torch

from miles_sync.env import bind_host
from miles_sync.transport.base import EngineTarget, RankSetup, SourceRank, TransportError, source_rank
from miles_sync.transport.group import UpdateGroup, create_update_group, start_store_server
from miles_sync.transport.membership import EngineEndpoint, GroupMembership
from miles_sync.wire.api import EngineError
from miles_sync.wire.bucket import FlattenedBucket
from miles_sync.wire.dtypes import dtype_name
from miles_sync.wire.protocol import (
    DestroyWeightsUpdateGroupRequest,
    LoadFormat,
    Selector,
    UpdateWeightsFromDistributedRequest,
)

__all__: list[str] = []  # nothing here is imported from outside miles_sync.transport

# How long to wait for the other engines' answers once the broadcast itself failed: they cannot succeed, we only
# want their messages for the error (an engine that received nothing answers when the group is torn down).
_FAILED_BROADCAST_GRACE_S = 2.0


def bucket_request(
    bucket: FlattenedBucket, *, selector: Selector, group_name: str, flush_cache: bool = False
) -> UpdateWeightsFromDistributedRequest:
    """The metadata POST of one bucket. Entries are in buffer order, so the receiver's rebuilt offsets (sum of the
    preceding byte sizes) are exactly the sender's. Pure.

    `flush_cache`: the engine flushes its prefix cache as it loads the bucket (RankSetup.flush_cache); else the
    session flushes it, or an in_place pause leaves it to the resume.
    """
    return UpdateWeightsFromDistributedRequest(
        names=tuple(e.name for e in bucket.entries),
        dtypes=tuple(dtype_name(e.dtype) for e in bucket.entries),
        shapes=tuple(tuple(e.shape) for e in bucket.entries),
        group_name=group_name,
        flush_cache=flush_cache,
        load_format=LoadFormat.FLATTENED_BUCKET,
        selector=selector,
    )


class DistributedTransport:
    """The source rank's side of the update group. Not thread-safe; one bucket in flight at a time."""

    name = "distributed"

    def __init__(
        self, *, engines: Sequence[EngineTarget], device: torch.device | str = "cpu", flush_cache: bool = False
    ) -> None:
        if not engines:
            raise ValueError("DistributedTransport needs at least one engine")
        self._engines = tuple(engines)
        self._device = torch.device(device)
        self._flush_cache = flush_cache
        self._group: UpdateGroup | None = None
        self._membership: GroupMembership | None = None
        self._delivery: asyncio.Future | None = None  # the last bucket's POSTs + broadcast

    async def open(self, *, membership: GroupMembership | None, timeout_s: float) -> GroupMembership:
        if membership is None:
            raise ValueError("the distributed transport needs a group membership")
        member_urls = [e.url for e in membership.engines]
        if member_urls != [e.client.url for e in self._engines]:
            raise ValueError(
                f"membership engines {member_urls} differ from the transport's {[e.client.url for e in self._engines]}"
            )
        await self.close(timeout_s=timeout_s)
        # The group meets where this (source) process runs, unless the controller named an address.
        address = bind_host() if membership.master_address is None else membership.master_address
        store = start_store_server(host=address, port=membership.master_port, timeout_s=timeout_s)
        bound = membership.bound_to(address=address, port=store.port)
        join = asyncio.ensure_future(
            asyncio.to_thread(
                create_update_group,
                master_address=bound.master_address,
                master_port=bound.master_port,
                rank=bound.source_rank,
                world_size=bound.world_size,
                group_name=bound.group_name,
                backend=bound.backend,
                timeout_s=timeout_s,
                store=store,
                local_address=address,
            )
        )
        inits = [
            asyncio.ensure_future(
                e.client.init_weights_update_group(bound.init_request(e.client.url), timeout_s=timeout_s)
            )
            for e in self._engines
        ]
        results = await _join_unless_refused(join, inits)
        group = results[0]
        failures = _failures(["source rank 0", *(e.client.url for e in self._engines)], results)
        if isinstance(group, UpdateGroup):
            self._group, self._membership = group, bound
        if failures:
            await self.close(timeout_s=timeout_s)
            raise TransportError(f"update group {bound.group_name!r} set-up failed: " + "; ".join(failures))
        return bound

    async def send_bucket(self, bucket: FlattenedBucket, *, selector: Selector, timeout_s: float) -> None:
        group, membership = self._group, self._membership
        if group is None or membership is None:
            raise TransportError("the distributed transport is not open (or was closed after a failure)")
        request = bucket_request(
            bucket, selector=selector, group_name=membership.group_name, flush_cache=self._flush_cache
        )
        try:
            group.check_broadcastable(bucket.buffer, src=membership.source_rank)  # before any engine is told
        except ValueError as e:
            raise TransportError(f"bucket of {len(bucket.entries)} tensors not sent: {e}") from None
        delivery = asyncio.ensure_future(
            self._deliver(bucket, request, group=group, src=membership.source_rank, timeout_s=timeout_s)
        )
        self._delivery = delivery
        # A cancelled send leaves the delivery running to its end (bounded by its timeouts); close() waits for it.
        failures = await asyncio.shield(delivery)
        if failures:
            raise TransportError(f"bucket of {len(bucket.entries)} tensors failed: " + "; ".join(failures))

    async def _deliver(
        self,
        bucket: FlattenedBucket,
        request: UpdateWeightsFromDistributedRequest,
        *,
        group: UpdateGroup,
        src: int,
        timeout_s: float,
    ) -> list[str]:
        """POST the metadata to every engine and broadcast the bucket; the failure lines, empty on success."""
        posts = [
            asyncio.create_task(e.client.update_weights_from_distributed(request, timeout_s=timeout_s))
            for e in self._engines
        ]
        # Handed to a thread before any await: once the POSTs are out, the bytes follow (the receivers block in the
        # broadcast until the source's half arrives, so it may well start first).
        broadcast = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(group.broadcast, bucket.buffer, src=src, timeout_s=timeout_s)
        )
        failures = []
        try:
            await broadcast
            answer_wait_s = timeout_s
        except (RuntimeError, TimeoutError) as e:
            failures.append(f"broadcast of bucket ({bucket.num_bytes} bytes): {e}")
            answer_wait_s = min(timeout_s, _FAILED_BROADCAST_GRACE_S)
        done, pending = await asyncio.wait(posts, timeout=answer_wait_s)
        for engine, post in zip(self._engines, posts):
            if post in pending:
                post.cancel()
                failures.append(f"{engine.client.url}: no answer within {answer_wait_s} s")
            elif post.exception() is not None:
                failures.append(f"{engine.client.url}: {post.exception()}")
        await asyncio.gather(*posts, return_exceptions=True)
        return failures

    async def close(self, *, timeout_s: float) -> None:
        """Destroy this side's group first (that unblocks engines still waiting in a receive), then ask every
        engine to destroy its side; engine failures are ignored (a dead engine has nothing to destroy)."""
        delivery, self._delivery = self._delivery, None
        if delivery is not None and not delivery.done():
            # A cancelled send's bucket is still being delivered: let the engines receive it and answer first.
            await asyncio.wait({delivery}, timeout=timeout_s)
        group, membership = self._group, self._membership
        self._group, self._membership = None, None
        if group is not None:
            await asyncio.to_thread(group.destroy)
        if membership is not None:
            request = DestroyWeightsUpdateGroupRequest(group_name=membership.group_name)
            await asyncio.gather(
                *(e.client.destroy_weights_update_group(request, timeout_s=timeout_s) for e in self._engines),
                return_exceptions=True,
            )


async def _join_unless_refused(join: asyncio.Future, inits: Sequence[asyncio.Future]) -> list[object]:
    """[join's result, each init's result], exceptions as values. An engine that answers its init call with a
    refusal can never join, so the rendezvous cannot complete: then this returns at once instead of waiting out the
    rendezvous timeout, with a TransportError in place of every call still running (an init that got no answer
    proves nothing: the rendezvous may still be under way, and its own timeout reports it). Those keep running in
    the background until their own timeout (a thread blocked in the rendezvous cannot be interrupted); a group the
    join still builds is destroyed, never used."""
    pending: set[asyncio.Future] = {join, *inits}
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        if pending and any(f is not join and _is_refusal(f.exception()) for f in done):
            break
    for future in pending:
        future.add_done_callback(_discard_late_result)
    abandoned = TransportError("abandoned: another member refused to join")
    return [abandoned if f in pending else (f.exception() or f.result()) for f in (join, *inits)]


def _is_refusal(exc: BaseException | None) -> bool:
    return isinstance(exc, EngineError) and exc.status is not None


def _discard_late_result(future: asyncio.Future) -> None:
    if future.cancelled() or future.exception() is not None:
        return  # the expected end: the rendezvous timed out
    result = future.result()
    if isinstance(result, UpdateGroup):
        result.destroy()


def _failures(who: Sequence[str], results: Sequence[object]) -> list[str]:
    return [f"{name}: {result}" for name, result in zip(who, results) if isinstance(result, BaseException)]


async def open_distributed_rank(*, engines: Sequence[EngineEndpoint], setup: RankSetup) -> SourceRank:
    """The source talks to every engine and hosts the update group; other ranks hold nothing."""
    return source_rank(
        DistributedTransport, engines=engines, setup=setup, device=setup.device, flush_cache=setup.flush_cache
    )
