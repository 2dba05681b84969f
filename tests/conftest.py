"""Test tiers follow the directory: tests/unit (pure), tests/multiproc (gloo groups, HTTP on loopback),
tests/ray (local Ray cluster), tests/sglang (real SGLang 0.5.23 servers on CPU, from the venv of
launch/install_sglang.sh). The marker is applied from the path so `-m unit` selects a tier.

Every Ray and real-SGLang test is also `slow` (a Ray module starts a cluster and an engine fleet, about 30 s before
its first test; a real CPU server takes 18-56 s to start), and so are the multi-process modules that start engines
per test (each says so): `-m "not slow"` is the quick loop, the unit tier plus the quick multi-process tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles_sync.env import LOOPBACK_HOST, socket_interface_env

_TIERS = ("unit", "multiproc", "ray", "sglang")

# Keep every local process group and server on loopback, and Ray's token file out of the home directory.
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps a single-node local cluster's processes on 127.0.0.1; only the simulated
# multi-node cluster's own nodes run with 1 (tests/ray/multinode.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
for _name, _value in socket_interface_env(LOOPBACK_HOST).items():  # gloo/NCCL interfaces, derived in miles_sync.env
    os.environ.setdefault(_name, _value)
os.environ.setdefault("MASTER_ADDR", LOOPBACK_HOST)


@pytest.fixture
def one_torch_thread():
    """One intra-op torch thread for the test (modules running small models in this process use it): batches of a
    few hundred tokens gain nothing from a second thread, which only contends on a shared 2-core machine."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def no_weights_are_reset(request: pytest.FixtureRequest):
    """No test's requests through a recording proxy (tests/recording_proxy.py) ask an engine's weights checker to
    reset_tensors, failure drills included; modules marked `allows_reset_tensors` are exempt."""
    import sys

    proxies = sys.modules.get("recording_proxy")
    already = 0 if proxies is None else len(proxies.RESET_REQUESTS)
    yield
    proxies = sys.modules.get("recording_proxy")
    if proxies is None or request.node.get_closest_marker("allows_reset_tensors") is not None:
        return
    resets = proxies.RESET_REQUESTS[already:]
    assert not resets, f"reset_tensors was sent through a recording proxy: {[(u, r.path) for u, r in resets]}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for tier in _TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
        if "ray" in parts or "sglang" in parts:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None:
            import torch

            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session")
def reference_checkpoints() -> Path:
    """Directory with the reference engine's pre-trained `target/` (with its MTP layer) and `draft/` checkpoints.

    Built once per recipe into the cache dir (MILES_SYNC_CACHE_DIR) by a subprocess, keyed by the recipe's hash,
    so later sessions start instantly; concurrent sessions wait on a file lock instead of training twice.
    """
    from miles_sync.engine.reference.checkpoints import cached_checkpoints
    from miles_sync.env import read_environment

    return cached_checkpoints(read_environment().cache_dir)


@pytest.fixture(scope="session")
def shape(reference_checkpoints: Path):
    """The reference target's TP dimensions (miles_sync.weights.engine_layout.TPShape), from its config.json."""
    import json

    from miles_sync.weights.engine_layout import TPShape

    return TPShape.from_config(json.loads((reference_checkpoints / "target" / "config.json").read_text()))


@pytest.fixture(scope="session")
def target_runner_weights(reference_checkpoints: Path):
    """The reference target runner's full HF tensors: the checkpoint without its MTP layer."""
    from reference_server import checkpoint_tensors, mtp_names

    path = reference_checkpoints / "target"
    draft = mtp_names(path)
    return {name: t for name, t in checkpoint_tensors(path).items() if name not in draft}


@pytest.fixture(scope="module")
def source(reference_checkpoints: Path):
    """A ProcessSource (tests/sender_host.py) exporting the reference target checkpoint from processes of its own,
    one per test module: a module's syncs may leave its transport open or its weights moved, so modules do not share
    it. Modules that need another source define their own `source`."""
    from sender_host import ProcessSource

    process_source = ProcessSource(target_dir=reference_checkpoints / "target")
    yield process_source
    process_source.shutdown()


@pytest.fixture(scope="session")
def reference_moe_checkpoint() -> Path:
    """The built-in pre-trained Qwen3-MoE reference checkpoint's `target/` (with its MTP layer), cached like the
    dense ones."""
    from miles_sync.engine.reference.checkpoints import cached_checkpoints
    from miles_sync.env import read_environment

    return cached_checkpoints(read_environment().cache_dir, arch="qwen3_moe") / "target"


@pytest.fixture(scope="session")
def sglang_source():
    """`sglang_source(version)`: the directory holding SGLang's source at that version, the package the test
    command installs into .venv-sglang (tests/sglang_source.py); another version or no venv fails the test."""
    from sglang_source import installed_sglang

    return installed_sglang
