"""Launch specs carry the engine's TP size: the reference engine's command line grows `--tp-size N` only for N > 1
(TP=1 command lines stay as they were), SGLang's always names it."""

from __future__ import annotations

import pytest

from miles_sync.engine.kinds import EngineKind, engine_spec
from miles_sync.engine.reference.launch import ReferenceEngineSpec
from miles_sync.engine.settings import EngineSettings
from miles_sync.wire.protocol import ChecksumNames

HOST = "127.0.0.1"


def _flag(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_reference_command_names_tp_only_above_one():
    single = ReferenceEngineSpec(model_dir="m").command(host=HOST).argv
    assert "--tp-size" not in single
    assert ReferenceEngineSpec(model_dir="m", tp_size=1).command(host=HOST).argv == single
    double = ReferenceEngineSpec(model_dir="m", tp_size=2).command(host=HOST).argv
    assert _flag(double, "--tp-size") == "2"
    assert [a for a in double if a not in ("--tp-size", "2")] == list(single)  # nothing else changes


@pytest.mark.parametrize("kind", list(EngineKind))
def test_every_kind_takes_the_tp_size_from_the_settings(kind):
    spec = engine_spec(kind, EngineSettings(model_dir="m", tp_size=4))
    assert spec.tp_size == 4
    assert engine_spec(kind, EngineSettings(model_dir="m")).tp_size == 1


def test_sglang_command_names_the_tp_size():
    spec = engine_spec(EngineKind.SGLANG, EngineSettings(model_dir="m", tp_size=2))
    assert _flag(spec.command(host=HOST).argv, "--tp-size") == "2"


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: EngineSettings(model_dir="m", tp_size=0), "invalid EngineSettings: tp_size=0 must be at least 1"),
        (
            lambda: ReferenceEngineSpec(model_dir="m", tp_size=-1, spec_steps=0),
            "tp_size=-1 must be at least 1",
        ),
        (lambda: ReferenceEngineSpec(model_dir="m", tp_size=0), "invalid ReferenceEngineSpec: tp_size=0"),
    ],
)
def test_tp_size_below_one_is_refused(make, expected):
    with pytest.raises(ValueError, match=expected):
        make()


def test_reference_command_names_the_checksum_names_only_when_chosen():
    default = ReferenceEngineSpec(model_dir="m").command(host=HOST).argv
    assert "--checksum-names" not in default  # the server's own default: HF names at TP=1
    engine = ReferenceEngineSpec(model_dir="m", checksum_names=ChecksumNames.ENGINE).command(host=HOST).argv
    assert _flag(engine, "--checksum-names") == "engine"
    assert [a for a in engine if a not in ("--checksum-names", "engine")] == list(default)
    with pytest.raises(ValueError, match="checksum_names='hf' needs tp_size 1"):
        ReferenceEngineSpec(model_dir="m", tp_size=2, checksum_names=ChecksumNames.HF)
