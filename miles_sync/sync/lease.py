"""The sync lease: at most one sync session at a time, and never a lock that outlives its holder.

A bare lock held by a caller that dies (a killed driver, a cancelled Ray task) would block every later sync. A lease
is a lock with an expiry: the holder renews it while it works, and a holder that stops renewing loses it after
`ttl_s`. Each grant carries a fencing `token` that increases with every grant, so a holder whose lease lapsed and
was granted to someone else can tell (renew fails with LeaseLostError) and must not commit anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sync


class LeaseBusyError(RuntimeError):
    """The lease is held by someone else for longer than the caller was willing to wait."""


class LeaseLostError(RuntimeError):
    """The caller's lease expired or was granted to another holder; its work must not be committed."""


@dataclass(frozen=True, kw_only=True)
class Lease:
    """One grant of the lease. `expires_at` is on the lease's clock (monotonic seconds by default)."""

    holder: str
    token: int
    expires_at: float


class SyncLease:
    """An in-process lease table for one resource. Safe to call from several threads and event loops.

    The clock is injectable so expiry is testable without sleeping.
    """

    def __init__(self, *, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s={ttl_s} must be positive")
        self._ttl_s = ttl_s
        self._clock = clock
        self._mutex = threading.Lock()
        self._current: Lease | None = None
        self._next_token = 1

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def current(self) -> Lease | None:
        """The live lease, or None when it is free or its holder let it expire."""
        with self._mutex:
            return self._live()

    def try_acquire(self, holder: str) -> Lease | None:
        """Grant the lease to `holder` if it is free or expired; None if someone holds it."""
        if not holder:
            raise ValueError("holder must be a non-empty id")
        with self._mutex:
            if self._live() is not None:
                return None
            lease = Lease(holder=holder, token=self._next_token, expires_at=self._clock() + self._ttl_s)
            self._next_token += 1
            self._current = lease
            return lease

    def renew(self, lease: Lease) -> Lease:
        """Extend `lease` by ttl_s from now. Raises LeaseLostError if it expired or another grant replaced it."""
        with self._mutex:
            live = self._live()
            if live is None or live.token != lease.token:
                now_holder = "nobody" if live is None else f"{live.holder!r} (token {live.token})"
                raise LeaseLostError(
                    f"sync lease of {lease.holder!r} (token {lease.token}) was lost; it is now held by {now_holder}"
                )
            renewed = Lease(holder=lease.holder, token=lease.token, expires_at=self._clock() + self._ttl_s)
            self._current = renewed
            return renewed

    def release(self, lease: Lease) -> bool:
        """Free the lease if `lease` is still the current grant; True if it was. Idempotent."""
        with self._mutex:
            if self._current is not None and self._current.token == lease.token:
                self._current = None
                return True
            return False

    async def acquire(self, holder: str, *, timeout_s: float, poll_s: float = 0.05) -> Lease:
        """Wait up to `timeout_s` for the lease. Raises LeaseBusyError naming the current holder."""
        deadline = time.monotonic() + timeout_s
        while True:
            lease = self.try_acquire(holder)
            if lease is not None:
                return lease
            if time.monotonic() >= deadline:
                busy = self.current()
                who = "nobody" if busy is None else f"{busy.holder!r} (token {busy.token})"
                raise LeaseBusyError(f"sync lease for {holder!r} not granted within {timeout_s} s: held by {who}")
            await asyncio.sleep(poll_s)

    @contextlib.asynccontextmanager
    async def hold(self, holder: str, *, timeout_s: float) -> AsyncIterator[LeaseHold]:
        """Acquire, renew in the background every ttl_s / 3, and release in `finally` however the body ends."""
        lease = await self.acquire(holder, timeout_s=timeout_s)
        held = LeaseHold(self, lease)
        renewer = asyncio.create_task(held.renew_forever(interval_s=self._ttl_s / 3))
        try:
            yield held
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            self.release(held.lease)

    def _live(self) -> Lease | None:
        # Caller holds the mutex. An expired grant is dropped here, so expiry needs no timer.
        if self._current is not None and self._current.expires_at <= self._clock():
            self._current = None
        return self._current


class LeaseHold:
    """A held lease plus its background renewal. `check()` before committing: it raises if the lease was lost."""

    def __init__(self, table: SyncLease, lease: Lease) -> None:
        self._table = table
        self.lease = lease

    def check(self) -> None:
        # Renewing is the check: it fails exactly when the grant lapsed or was replaced.
        self.lease = self._table.renew(self.lease)

    async def renew_forever(self, *, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.lease = self._table.renew(self.lease)
            except LeaseLostError:
                return  # check() reports the loss to the holder
