"""The sync lease: grants, renewal, expiry when the holder stops renewing, fencing tokens, release in finally."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles_sync.sync.lease import LeaseBusyError, LeaseLostError, SyncLease


class ManualClock:
    """Time that moves only when the test says so: expiry is tested without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_grant_is_exclusive_until_released():
    clock = ManualClock()
    lease = SyncLease(ttl_s=10.0, clock=clock)
    first = lease.try_acquire("trainer-0")
    assert first is not None and first.holder == "trainer-0" and first.expires_at == 1010.0
    assert lease.try_acquire("trainer-1") is None
    assert lease.current() == first
    assert lease.release(first) is True
    assert lease.current() is None
    second = lease.try_acquire("trainer-1")
    assert second is not None and second.token > first.token


def test_expires_when_the_holder_stops_renewing():
    clock = ManualClock()
    lease = SyncLease(ttl_s=10.0, clock=clock)
    dead = lease.try_acquire("killed-driver")
    clock.now += 9.999
    assert lease.try_acquire("next") is None  # still inside its TTL
    clock.now += 0.002
    assert lease.current() is None
    taken = lease.try_acquire("next")
    assert taken is not None and taken.token == dead.token + 1
    # The late holder finds out on its next renewal, and its release cannot free the new grant.
    with pytest.raises(LeaseLostError, match="killed-driver.*now held by 'next'"):
        lease.renew(dead)
    assert lease.release(dead) is False
    assert lease.current() == taken


def test_renew_extends_from_now():
    clock = ManualClock()
    lease = SyncLease(ttl_s=10.0, clock=clock)
    grant = lease.try_acquire("a")
    clock.now += 8.0
    renewed = lease.renew(grant)
    assert renewed.token == grant.token and renewed.expires_at == clock.now + 10.0
    clock.now += 8.0  # past the first expiry, inside the renewed one
    assert lease.current() == renewed
    clock.now += 2.0
    with pytest.raises(LeaseLostError, match="now held by nobody"):
        lease.renew(renewed)


def test_release_is_idempotent():
    lease = SyncLease(ttl_s=5.0, clock=ManualClock())
    grant = lease.try_acquire("a")
    assert lease.release(grant) is True
    assert lease.release(grant) is False


@pytest.mark.parametrize("ttl_s", [0.0, -1.0])
def test_ttl_must_be_positive(ttl_s):
    with pytest.raises(ValueError, match=f"ttl_s={ttl_s} must be positive"):
        SyncLease(ttl_s=ttl_s)


def test_holder_must_be_named():
    with pytest.raises(ValueError, match="holder"):
        SyncLease(ttl_s=1.0).try_acquire("")


def test_acquire_waits_then_names_the_holder():
    async def main():
        lease = SyncLease(ttl_s=60.0)
        lease.try_acquire("sync-7")
        with pytest.raises(LeaseBusyError, match="held by 'sync-7'"):
            await lease.acquire("sync-8", timeout_s=0.1, poll_s=0.02)

    asyncio.run(main())


def test_acquire_gets_the_lease_once_it_is_released():
    async def main():
        lease = SyncLease(ttl_s=60.0)
        first = lease.try_acquire("a")
        asyncio.get_running_loop().call_later(0.05, lease.release, first)
        second = await lease.acquire("b", timeout_s=5.0, poll_s=0.01)
        assert second.holder == "b"

    asyncio.run(main())


def test_hold_releases_in_finally_on_error_and_on_cancellation():
    async def main():
        lease = SyncLease(ttl_s=60.0)
        with pytest.raises(RuntimeError, match="boom"):
            async with lease.hold("a", timeout_s=1.0):
                raise RuntimeError("boom")
        assert lease.current() is None

        entered = asyncio.Event()

        async def holder():
            async with lease.hold("b", timeout_s=1.0):
                entered.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(holder())
        await entered.wait()
        assert lease.current().holder == "b"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lease.current() is None

    asyncio.run(main())


def test_hold_renews_in_the_background():
    """The manual clock moves 2/3 of a TTL at a time, 4 times (2.7 TTLs in all); after each move the test waits
    (on the lease's state, real time bounded) for the renewer to extend the grant to a full TTL from the new now.
    Without background renewal the first wait times out, and by the second move the grant would have lapsed."""

    async def main():
        clock = ManualClock()
        lease = SyncLease(ttl_s=0.3, clock=clock)  # the renewer ticks every 0.1 real seconds
        async with lease.hold("long-sync", timeout_s=1.0) as held:
            for _ in range(4):
                clock.now += 0.2
                deadline = time.monotonic() + 5.0
                while lease.current().expires_at != clock.now + 0.3:
                    assert time.monotonic() < deadline, "the hold did not renew its lease"
                    await asyncio.sleep(0.01)
            assert lease.try_acquire("other") is None
            held.check()
        assert lease.current() is None

    asyncio.run(main())


def test_check_fails_once_the_lease_was_lost():
    async def main():
        clock = ManualClock()
        lease = SyncLease(ttl_s=30.0, clock=clock)  # renewer ticks every 10 real seconds: never, in this test
        async with lease.hold("stalled", timeout_s=1.0) as held:
            held.check()
            clock.now += 31.0
            assert lease.try_acquire("other") is not None
            with pytest.raises(LeaseLostError, match="stalled"):
                held.check()

    asyncio.run(main())
