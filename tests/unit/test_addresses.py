"""Addresses and node layout, pure: the bind address each actor adopts, the interface gloo/NCCL use for it, the
colocated node check, per-role placement strategies and the cluster config's node keys."""

from __future__ import annotations

import pytest

from miles_sync.config import ClusterConfig
from miles_sync.env import (
    SOCKET_INTERFACE_VARIABLES,
    bind_host,
    node_of_url,
    socket_interface,
    socket_interface_env,
)
from miles_sync.job.placement import Resources, plan_placement
from miles_sync.transport.feeds import EngineFeed, FeedPlan, feed_node_problems
from miles_sync.transport.membership import EngineEndpoint


@pytest.fixture
def no_host(monkeypatch):
    monkeypatch.delenv("MILES_SYNC_HOST", raising=False)


@pytest.mark.parametrize(
    ("override", "node_ip", "environment", "expected"),
    [
        (None, None, None, "127.0.0.1"),  # nothing known: loopback
        (None, None, "127.0.0.9", "127.0.0.9"),  # the process's adopted address
        (None, "10.1.2.3", "127.0.0.9", "10.1.2.3"),  # the actor's node beats the environment
        ("10.9.9.9", "10.1.2.3", None, "10.9.9.9"),  # an explicit cluster.bind_host beats everything
        ("0.0.0.0", "10.1.2.3", None, "0.0.0.0"),  # every interface: only when asked for explicitly
        (None, "localhost", None, "127.0.0.1"),
        ("[fd00::2]", None, None, "fd00::2"),
    ],
)
def test_bind_host_precedence(monkeypatch, override, node_ip, environment, expected):
    if environment is None:
        monkeypatch.delenv("MILES_SYNC_HOST", raising=False)
    else:
        monkeypatch.setenv("MILES_SYNC_HOST", environment)
    assert bind_host(override=override, node_ip=node_ip) == expected


def test_bind_host_refuses_names_and_implicit_wildcards(no_host):
    with pytest.raises(ValueError, match=r"cluster.bind_host='head-node' is not an IP address"):
        bind_host(override="head-node")
    with pytest.raises(ValueError, match=r"node IP='0.0.0.0' binds every interface"):
        bind_host(node_ip="0.0.0.0")


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.3", "127.255.0.1", "localhost", "::1"])
def test_every_loopback_address_selects_the_loopback_interface(address):
    assert socket_interface(address) == socket_interface("127.0.0.1") == "lo"
    assert socket_interface_env(address) == dict.fromkeys(SOCKET_INTERFACE_VARIABLES, "lo")
    assert set(SOCKET_INTERFACE_VARIABLES) == {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}


def test_wildcards_leave_the_interface_to_the_libraries_and_foreign_addresses_fail():
    assert socket_interface("0.0.0.0") is None and socket_interface_env("::") == {}
    with pytest.raises(ValueError, match="no network interface of this machine has the address 198.51.100.77"):
        socket_interface("198.51.100.77")  # TEST-NET-2: never configured on a test machine


def test_node_of_url():
    assert node_of_url("http://127.0.0.3:30000") == "127.0.0.3"
    assert node_of_url("http://localhost:1/") == "127.0.0.1"
    assert node_of_url("http://[fd00::2]:8000") == "fd00::2"
    assert node_of_url("http://rollout-3:8000") == "rollout-3"
    with pytest.raises(ValueError, match="names no host"):
        node_of_url("127.0.0.1")


ENGINES = (EngineEndpoint(url="http://10.0.0.2:1", tp_size=1), EngineEndpoint(url="http://10.0.0.3:1", tp_size=2))
ENGINE_NODES = ("10.0.0.2", "10.0.0.3")


def test_engines_fed_on_their_own_nodes_pass():
    plan = FeedPlan(
        num_trainers=3,
        engines=(EngineFeed(feeders=(0,), poster=0), EngineFeed(feeders=(1, 2), poster=1)),
    )
    nodes = ["10.0.0.2", "10.0.0.3", "10.0.0.3"]
    assert feed_node_problems(plan=plan, trainer_nodes=nodes, engines=ENGINES, engine_nodes=ENGINE_NODES) == []


def test_an_engine_fed_across_nodes_is_named_with_its_node():
    single = FeedPlan.single_source(tp_sizes=(1, 2), rank=0, num_trainers=2)  # the source feeds everything
    problems = feed_node_problems(
        plan=single, trainer_nodes=["10.0.0.2", "10.0.0.2"], engines=ENGINES, engine_nodes=ENGINE_NODES
    )
    assert problems == [
        "engine 1 (http://10.0.0.3:1) on node 10.0.0.3 would be fed across nodes by rank 0 on 10.0.0.2 "
        "(no trainer rank runs on it)"
    ]
    problems = feed_node_problems(
        plan=single, trainer_nodes=["10.0.0.2", "10.0.0.3"], engines=ENGINES, engine_nodes=ENGINE_NODES
    )
    assert problems == [
        "engine 1 (http://10.0.0.3:1) on node 10.0.0.3 would be fed across nodes by rank 0 on 10.0.0.2 "
        "(trainer ranks [1] are on it)"
    ]


def test_engine_strategy_places_the_engines_group_on_its_own_terms():
    one = Resources(num_cpus=0.01)
    plan = plan_placement(
        layout="disaggregated", num_trainers=2, num_engines=2, trainer=one, engine=one, engine_strategy="STRICT_SPREAD"
    )
    assert [(g.name, g.strategy) for g in plan.groups] == [("trainers", "PACK"), ("engines", "STRICT_SPREAD")]
    plan = plan_placement(layout="disaggregated", num_trainers=1, num_engines=1, trainer=one, engine=one)
    assert [g.strategy for g in plan.groups] == ["PACK", "PACK"]
    with pytest.raises(ValueError, match=r"engine_strategy='SCATTER' is not one of"):
        plan_placement(
            layout="disaggregated", num_trainers=1, num_engines=1, trainer=one, engine=one, engine_strategy="SCATTER"
        )


def test_cluster_config_names_every_bad_node_key():
    with pytest.raises(ValueError) as info:
        ClusterConfig(bind_host="head", trainer_strategy="SCATTER", engine_strategy="pack", engine_node_resource="CPU")
    for named in ("'head' is not an IP address", "trainer_strategy='SCATTER'", "engine_strategy='pack'", "'CPU'"):
        assert named in str(info.value)
    assert ClusterConfig(bind_host="0.0.0.0", engine_node_resource="rollout_node").bind_host == "0.0.0.0"
