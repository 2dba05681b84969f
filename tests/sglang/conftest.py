"""Real SGLang 0.5.23 servers on CPU for the sglang tier, from the venv launch/install_sglang.sh makes (the test
command installs it; a missing venv fails the tier, naming the step, never skips it).

An idle CPU server keeps one core busy, so no two modules' servers overlap: a module either starts the few servers
it needs itself (module scope) or takes them from the tier's pool (`server_pool`: servers of one kind kept from one
module to the next, each reset to a fresh server's state; tests/sglang_server.py), which stops its servers after
a module's last test when the next module does not use it (or at the tier's end). The modules run in MODULE_ORDER,
so the ones that share a pooled kind follow each other, the one whose last test kills the server last.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_server import SGLANG_PYTHON, ServerKind, ServerPool

from miles_sync.transport.p2p_loader import LOADER_PATH

# The tier's modules in run order; any other runs after them, in collection order.
MODULE_ORDER = (
    "test_conformance.py",
    "test_sglang_sync.py",
    "test_sglang_load.py",
    "test_sglang_tp2.py",  # the pooled TP=2 server
    "test_direct_load_sglang.py",  # the same server at TP=2 (its last TP=2 test kills it), then its own TP=1 one
    "test_sglang_moe.py",
    "test_sglang_auth.py",
    "test_sglang_job.py",
    "test_sglang_gpu.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = [i for i, item in enumerate(items) if Path(str(item.fspath)).parent.name == "sglang"]
    if not tier:
        return
    rank = {name: position for position, name in enumerate(MODULE_ORDER)}
    ordered = sorted((items[i] for i in tier), key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))
    for i, item in zip(tier, ordered):  # stable: a module's own order (its parameter groups) is kept
        items[i] = item


_POOL: list[ServerPool] = []


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if not _POOL:
        return
    if nextitem is None or (nextitem.module is not item.module and "server_pool" not in nextitem.fixturenames):
        _POOL[0].release()  # the next module starts its own servers, or the tier is over


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    if not SGLANG_PYTHON.is_file():
        pytest.fail(f"no SGLang server venv at {SGLANG_PYTHON.parent.parent}: run `bash launch/install_sglang.sh`")
    return SGLANG_PYTHON


@pytest.fixture(scope="session")
def server_pool(sglang_python, tmp_path_factory):
    pool = ServerPool(python=sglang_python, log_dir=tmp_path_factory.mktemp("sglang-pool"))
    _POOL.append(pool)
    try:
        yield pool
    finally:
        pool.release()
        _POOL.remove(pool)


@pytest.fixture(scope="session")
def target_tp2_kind(reference_checkpoints) -> ServerKind:
    """TP=2 servers of the reference target with the p2p loader."""
    return ServerKind(model=reference_checkpoints / "target", tp_size=2, custom_weight_loaders=(LOADER_PATH,))
