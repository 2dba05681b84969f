"""The reference engine's auth decision, table-tested against SGLang 0.5.23's `decide_request_auth` rules.

The expected column is written out by hand from SGLang's source (srt/utils/auth.py), not computed: for
ADMIN_OPTIONAL routes the admin key when one is set (the API key is NOT accepted), else the API key when one is set,
else open; for NORMAL routes the API key when one is set (the admin key is NOT accepted), else open; /health*,
/ready*, /metrics* and OPTIONS always open; `Bearer` scheme case-insensitive, exactly one space.
"""

from __future__ import annotations

import itertools

import pytest

from miles_sync.engine.reference.server import AuthLevel, decide_auth

API = "api-key-1"
ADMIN = "admin-key-2"

ADMIN_LEVEL = AuthLevel.ADMIN_OPTIONAL
NORMAL = AuthLevel.NORMAL

# (configured api key, configured admin key) -> presented key -> level -> the key the request lacks (None: passes)
_NO_KEYS = {
    ADMIN_LEVEL: {None: None, API: None, ADMIN: None, "wrong": None},
    NORMAL: {None: None, API: None, ADMIN: None, "wrong": None},
}
_API_ONLY = {
    ADMIN_LEVEL: {None: "api key", API: None, ADMIN: "api key", "wrong": "api key"},
    NORMAL: {None: "api key", API: None, ADMIN: "api key", "wrong": "api key"},
}
_ADMIN_ONLY = {
    ADMIN_LEVEL: {None: "admin api key", API: "admin api key", ADMIN: None, "wrong": "admin api key"},
    NORMAL: {None: None, API: None, ADMIN: None, "wrong": None},
}
_BOTH = {
    ADMIN_LEVEL: {None: "admin api key", API: "admin api key", ADMIN: None, "wrong": "admin api key"},
    NORMAL: {None: "api key", API: None, ADMIN: "api key", "wrong": "api key"},
}
TABLE = {(None, None): _NO_KEYS, (API, None): _API_ONLY, (None, ADMIN): _ADMIN_ONLY, (API, ADMIN): _BOTH}

CASES = [
    (configured, presented, level, TABLE[configured][level][presented])
    for configured, presented, level in itertools.product(TABLE, [None, API, ADMIN, "wrong"], [ADMIN_LEVEL, NORMAL])
]


@pytest.mark.parametrize(("configured", "presented", "level", "missing"), CASES)
def test_every_combination_of_keys_presented_key_and_level(configured, presented, level, missing):
    api_key, admin_api_key = configured
    authorization = None if presented is None else f"Bearer {presented}"
    decided = decide_auth(
        method="POST",
        path="/begin_weight_update",
        authorization=authorization,
        api_key=api_key,
        admin_api_key=admin_api_key,
        level=level,
    )
    assert decided == missing


@pytest.mark.parametrize("path", ["/health", "/health_generate", "/healthz", "/ready", "/metrics"])
@pytest.mark.parametrize("level", [ADMIN_LEVEL, NORMAL])
def test_health_ready_and_metrics_paths_are_always_open(path, level):
    decided = decide_auth(method="GET", path=path, authorization=None, api_key=API, admin_api_key=ADMIN, level=level)
    assert decided is None


def test_options_is_always_open():
    for level in (ADMIN_LEVEL, NORMAL):
        assert (
            decide_auth(
                method="OPTIONS", path="/generate", authorization=None, api_key=API, admin_api_key=ADMIN, level=level
            )
            is None
        )


@pytest.mark.parametrize(
    ("authorization", "passes"),
    [
        (f"Bearer {API}", True),
        (f"bearer {API}", True),  # the scheme is case-insensitive
        (f"BEARER {API}", True),
        (f"Bearer  {API}", False),  # exactly one space: the token would start with a space
        (f"Bearer {API} ", False),
        (API, False),
        (f"Basic {API}", False),
        ("Bearer ", False),
        ("", False),
        ("Bearer \u00e9\u00e8", False),  # non-ASCII never raises
    ],
)
def test_bearer_header_forms(authorization, passes):
    decided = decide_auth(
        method="POST", path="/generate", authorization=authorization, api_key=API, admin_api_key=None, level=NORMAL
    )
    assert (decided is None) is passes
