"""The Ray tier's shared fixture: `cluster`, a local Ray cluster (two CPUs, loopback) per test module. Modules
that need several simulated nodes define their own (tests/ray/multinode.py); two clusters never run at once in
one process, which is why this one is not session-scoped."""

from __future__ import annotations

import pytest
from ray_fleet import local_ray


@pytest.fixture(scope="module")
def cluster():
    with local_ray(num_cpus=2):
        yield
