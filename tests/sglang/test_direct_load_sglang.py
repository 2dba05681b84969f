"""Differential: `update_weights_from_tensor` with `load_format: "direct"` sent alike to a real SGLang 0.5.23 CPU
server and to a reference engine, at TP=2 then TP=1 (one pair at a time, module-scoped; the real server from the
tier's pool, the reference engine stopped when its TP size is done). Each case compares the answers' status and
success and every rank's checker digests.

What SGLang 0.5.23 does, measured on this machine (CPU, float32 target checkpoint, selector "target" sessions):
- payload i is decoded by TP rank i only; `_model_load_weights_direct` copies each (engine name, local tensor) into
  `dict(model.named_parameters())[name]`: correct names and shapes answer 200 {"success": true, "message":
  "Success"}, every rank's checker digests equal `rank_engine_digests` of the sent weights, generation goes on.
  Payloads swapped between the TP=2 ranks load too (each rank stores the other's shards). Tensors that all view
  one shared storage load like separate ones.
- a dtype other than the parameter's (bfloat16 or float64 into float32) is cast silently (`copy_`): 200.
- an unknown name (`KeyError: 'model.layers.0.self_attn.q_proj.weight'`, an HF name: the parameter is qkv_proj) or
  a wrong shape (`AssertionError: Attempted to load weight (torch.Size([3, 5])) into parameter
  (torch.Size([128, 384]))`) raises in the scheduler: SIGQUIT, kill_process_tree, at TP=1 and TP=2. The request
  gets no answer (RemoteDisconnected), the process exits, /health_generate refuses connections. Whether tensors
  before the bad one were written cannot be observed: nothing serves them again.
So the crash case runs last for each TP size.

Both servers also run the p2p loader as their custom weight loader (`--custom-weight-loader`,
miles_sync.transport.p2p_loader; the project installs miles_sync into SGLang's venv without its dependencies):
- an update whose payloads are tickets, load_format = the loader's path, runs the loader on every TP rank with its
  own ticket: each rank joins the channel and receives its tensors point to point from two trainer ranks (threads
  here), straight into its parameters; every rank's digests then equal the sent weights', and a tensor whose
  bytes do not match the digest sent with it is refused by the rank that took it in, named by its index, alike.
- a load_format that is no allowed loader's path ends SGLang's scheduler (`NotImplementedError: Unknown
  load_format`): the TP=1 crash case sends one.
"""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from p2p_session import p2p_update, post
from reference_server import reference_server
from sglang_server import enter_together, sglang_server

from miles_sync.transport.p2p_loader import LOADER_PATH, TICKET_NAME, Refusal
from miles_sync.weights.engine_layout import rank_engine_digests, rank_engine_tensors
from miles_sync.wire.payload import encode_inline_named_tensors, encode_named_tensors

NORM = "model.norm.weight"
QKV = "model.layers.0.self_attn.qkv_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
CRASH_WAIT_S = 30.0  # SGLang sleeps 5 s for crash diagnostics before it kills its process tree


# TP=2 first: its real server is the pooled one test_sglang_tp2.py ran on (this module's last TP=2 test kills it).
@pytest.fixture(scope="module", params=[2, 1], ids=["tp2", "tp1"])
def servers(request, reference_checkpoints, server_pool, target_tp2_kind, tmp_path_factory):
    """{"sglang": url, "reference": url} plus the processes, for one TP size: at TP=2 the real server from the
    tier's pool, at TP=1 one of its own, started while its reference engine starts. The last test of each TP size
    kills both."""
    tp_size = request.param
    target = reference_checkpoints / "target"
    log_dir = tmp_path_factory.mktemp(f"direct-tp{tp_size}")
    hook = ["--custom-weight-loader", LOADER_PATH]
    names = {"checksum_names": "engine", "extra_args": hook}
    if tp_size > 1:
        names = {"extra_args": [*hook, "--tp-size", str(tp_size)]}
    reference = reference_server(model=target, log_dir=log_dir, finalize_policy="sglang", **names)
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(max_workers=1) as starting:
        if tp_size == 2:
            pooled = starting.submit(server_pool.get, target_tp2_kind, 1)
            ref = stack.enter_context(reference)
            (real,) = pooled.result()
        else:
            server_pool.release()  # the pooled TP=2 server is dead by now; no pooled server runs beside this one
            own = sglang_server(
                model=target, python=server_pool.python, log_dir=log_dir, custom_weight_loaders=(LOADER_PATH,)
            )
            real, ref = enter_together(stack, own, reference)
        yield {"tp_size": tp_size, "sglang": real, "reference": ref}


def digests(url: str) -> list[dict[str, str]]:
    status, answer = post(url, "/weights_checker", {"action": "checksum", "selector": "target"})
    assert status == 200, answer
    return [rank["checksums"] for rank in answer["ranks"]]


def direct_update(url: str, payloads: list[str]) -> tuple[int, object] | OSError:
    """begin (selector target), one direct update, end if it answered; the update's (status, body) or error."""
    assert post(url, "/begin_weight_update", {"selector": "target"})[0] == 200
    body = {"serialized_named_tensors": payloads, "load_format": "direct", "flush_cache": False, "selector": "target"}
    try:
        answer = post(url, "/update_weights_from_tensor", body, timeout_s=60.0)
    except OSError as exc:
        return exc
    ended = post(url, "/end_weight_update")
    assert ended[0] == 200, (url, answer, ended)
    return answer


def unknown_loader_update(url: str, payload: str) -> tuple[int, object] | OSError:
    assert post(url, "/begin_weight_update", {"selector": "target"})[0] == 200
    body = {"serialized_named_tensors": [payload], "load_format": "miles_sync.no_such.loader", "selector": "target"}
    try:
        return post(url, "/update_weights_from_tensor", body, timeout_s=60.0)
    except OSError as exc:
        return exc


def both(servers, payloads: list[str]) -> dict[str, tuple[int, object] | OSError]:
    return {kind: direct_update(servers[kind].url, payloads) for kind in ("sglang", "reference")}


def perturbed(weights, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in sorted(weights.items())}


def rank_tensors(weights, *, shape, tp_size: int) -> list[list[tuple[str, torch.Tensor]]]:
    return [
        sorted(rank_engine_tensors(weights, shape=shape, tp_rank=r, tp_size=tp_size).items()) for r in range(tp_size)
    ]


def assert_same_success_and_digests(servers, answers, expected_weights, *, shape) -> None:
    (status, body), (ref_status, ref_body) = answers["sglang"], answers["reference"]
    assert (status, body["success"]) == (ref_status, ref_body["success"]) == (200, True), answers
    expected = list(rank_engine_digests([("target", expected_weights)], shape=shape, tp_size=servers["tp_size"]))
    real, ref = digests(servers["sglang"].url), digests(servers["reference"].url)
    assert [{n: r[n] for n in e} for r, e in zip(real, expected)] == expected  # SGLang may answer more names
    assert ref == expected


def test_a_direct_load_of_each_ranks_shards_lands_alike(servers, target_runner_weights, shape):
    weights = perturbed(target_runner_weights, seed=servers["tp_size"])
    keep = rank_tensors(weights, shape=shape, tp_size=servers["tp_size"])
    before = digests(servers["reference"].url)
    answers = both(servers, [encode_named_tensors(named) for named in keep])
    assert_same_success_and_digests(servers, answers, weights, shape=shape)
    assert digests(servers["reference"].url) != before
    for kind in ("sglang", "reference"):
        body = {"input_ids": [3, 100, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        status, answer = post(servers[kind].url, "/generate", body)
        assert status == 200 and len(answer["output_ids"]) == 4, (kind, answer)


def test_a_dtype_other_than_the_parameters_is_cast_alike(servers, target_runner_weights, shape):
    weights = perturbed(target_runner_weights, seed=10 + servers["tp_size"])
    weights[NORM] = weights[NORM] + 1.0
    keep = []
    for named in rank_tensors(weights, shape=shape, tp_size=servers["tp_size"]):
        keep.append(
            [(n, t.to(torch.bfloat16) if n == NORM else t.to(torch.float64) if n == QKV else t) for n, t in named]
        )
    answers = both(servers, [encode_named_tensors(named) for named in keep])
    assert_same_success_and_digests(
        servers, answers, {**weights, NORM: weights[NORM].to(torch.bfloat16).float()}, shape=shape
    )


def test_a_p2p_update_lands_alike(servers, target_runner_weights, shape):
    tp_size = servers["tp_size"]
    for seed in (20 + tp_size, 30 + tp_size):  # twice: the second update reuses each rank's channel
        weights = perturbed(target_runner_weights, seed=seed)
        per_rank = [rank_engine_tensors(weights, shape=shape, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
        statuses = {kind: p2p_update(servers[kind].url, per_rank) for kind in ("sglang", "reference")}
        assert statuses["sglang"] == statuses["reference"], statuses
        assert all(s.refusal is Refusal.NONE for s in statuses["sglang"])
        assert sum(s.checked for s in statuses["sglang"]) == sum(len(t) for t in per_rank)
        expected = list(rank_engine_digests([("target", weights)], shape=shape, tp_size=tp_size))
        real, ref = digests(servers["sglang"].url), digests(servers["reference"].url)
        assert [{n: r[n] for n in e} for r, e in zip(real, expected)] == expected
        assert ref == expected


def test_a_corrupted_p2p_tensor_is_refused_alike(servers, target_runner_weights, shape):
    tp_size = servers["tp_size"]
    weights = perturbed(target_runner_weights, seed=40 + tp_size)
    per_rank = [rank_engine_tensors(weights, shape=shape, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
    statuses = {kind: p2p_update(servers[kind].url, per_rank, corrupt=DOWN) for kind in ("sglang", "reference")}
    assert statuses["sglang"] == statuses["reference"], statuses
    assert [s.refusal for s in statuses["sglang"] if s.refusal is not Refusal.NONE] == [Refusal.DIGEST]


def test_a_tensor_sglang_dies_on_kills_both_servers(servers, target_runner_weights, shape):
    """Last for its TP size: TP=1 names a load_format no loader was allowed for, TP=2 sends a wrong shape on rank
    1 only."""
    named = rank_tensors(target_runner_weights, shape=shape, tp_size=servers["tp_size"])
    if servers["tp_size"] == 1:
        ticket = encode_inline_named_tensors([(TICKET_NAME, torch.zeros(3, dtype=torch.uint8))])
        answers = {kind: unknown_loader_update(servers[kind].url, ticket) for kind in ("sglang", "reference")}
    else:
        keep = [named[0], [(n, torch.zeros(3, 5) if n == DOWN else t) for n, t in named[1]]]
        # A payload per server (`keep` holds the tensors until both answered): the real server dies holding the
        # mapping of the one it opened, so its pending reference is never released.
        answers = {
            kind: direct_update(servers[kind].url, [encode_named_tensors(tensors) for tensors in keep])
            for kind in ("sglang", "reference")
        }
    assert all(isinstance(answer, OSError) for answer in answers.values()), answers  # no answer from either
    deadline = time.monotonic() + CRASH_WAIT_S
    while servers["sglang"].is_running or servers["reference"].process.poll() is None:
        assert time.monotonic() < deadline, "a server kept running after the crash"
        time.sleep(0.5)
    for kind in ("sglang", "reference"):
        with pytest.raises(OSError):
            urllib.request.urlopen(servers[kind].url + "/health_generate", timeout=5.0)
