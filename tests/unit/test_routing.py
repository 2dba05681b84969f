"""The routing plan: which engines a router in front of the fleet must withdraw and admit (pure, table-tested),
and the /generate body rule that lets the SGLang router's requests through (its extra keys at SGLang's defaults)."""

from __future__ import annotations

import pytest

from miles_sync.sync.routing import plan_routing
from miles_sync.wire.codec import decode
from miles_sync.wire.protocol import GenerateRequest, generate_request_fields, unserved_generate_keys

pytestmark = pytest.mark.unit

A, B, C, D = "http://127.0.0.2:1", "http://127.0.0.3:1", "http://127.0.0.4:1", "http://127.0.0.5:1"


@pytest.mark.parametrize(
    ("fleet", "routed", "serving", "withdraw", "admit"),
    [
        # at connect, nothing routed yet: every serving engine is admitted, in fleet order
        ((A, B), (), (A, B), (), (A, B)),
        # a sync held B: withdrawn, A stays
        ((A, B), (A, B), (A,), (B,), ()),
        # a later sync verified B again: admitted
        ((A, B), (A,), (A, B), (), (B,)),
        # a joiner C is in the fleet but stale: neither routed nor admitted
        ((A, B, C), (A, B), (A, B), (), ()),
        # C verified: admitted after the others' order
        ((C, A, B), (A, B), (A, B, C), (), (C,)),
        # D left the fleet while routed: withdrawn even though it still "serves"
        ((A,), (A, D), (A, D), (D,), ()),
        # nothing serves: everything routed is withdrawn
        ((A, B), (A, B), (), (A, B), ()),
    ],
)
def test_the_plan_brings_the_routed_set_to_the_serving_engines(fleet, routed, serving, withdraw, admit):
    plan = plan_routing(fleet=fleet, routed=routed, serving=serving)
    assert plan.withdraw == withdraw and plan.admit == admit
    after = (set(routed) - set(plan.withdraw)) | set(plan.admit)
    assert after == set(serving) & set(fleet)


ROUTER_BODY = {  # what sglang-router 0.3.2 posts to a worker's /generate (captured from the router)
    "model": None,
    "input_ids": [1, 2, 3],
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}


def test_the_routers_generate_body_decodes_as_sglang_takes_it():
    assert unserved_generate_keys(ROUTER_BODY) == []
    request = decode(GenerateRequest, generate_request_fields(ROUTER_BODY))
    assert request.input_ids == (1, 2, 3) and request.sampling_params.max_new_tokens == 4


@pytest.mark.parametrize(
    ("key", "value"), [("stream", True), ("return_hidden_states", True), ("input_embeds", [[0.0]]), ("image_data", "x")]
)
def test_a_field_this_engine_does_not_implement_is_refused_at_any_other_value(key, value):
    assert unserved_generate_keys({**ROUTER_BODY, key: value}) == [f"{key}={value!r}"]


def test_keys_sglang_does_not_declare_are_dropped_and_sampling_params_stay_strict():
    assert "model" not in generate_request_fields({**ROUTER_BODY, "model": "m", "typo_key": 1})
    with pytest.raises(ValueError, match="unknown key"):
        decode(GenerateRequest, generate_request_fields({**ROUTER_BODY, "sampling_params": {"top_kk": 3}}))
