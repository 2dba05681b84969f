"""The `engines.kind=sglang` command line, checked against the flags SGLang 0.5.23's server parser defines.

Every command the spec builds is parsed by a parser rebuilt from the vendored flag list
(tests/data/sglang_server_flags.json: option strings, value or switch, nargs, type, choices), exactly as SGLang's
argparse would take it: an unknown or abbreviated option, a missing value, a value of the wrong type or outside
the choices fails the parse. The parsed values are then compared with what the settings asked for. The list is
re-derived from the released wheel when it can be had, so a renamed flag fails here, not in a user's job.
"""

from __future__ import annotations

import re
import sys

import pytest
from sglang_flags import (
    ServerArgsError,
    ServerFlags,
    derive_server_flags,
    parse_server_args,
    vendored_server_flags,
)

from miles_sync.config import EngineConfig, MilesSyncConfig, ModelConfig
from miles_sync.engine.kinds import EngineKind, engine_spec
from miles_sync.engine.settings import EngineSettings, LoraSettings
from miles_sync.engine.sglang import (
    SGLANG_LAUNCH_MODULE,
    SGLangEngineSpec,
    cpu_environment,
    sglang_speculative_problems,
)
from miles_sync.engine.sglang_launch import server_argv
from miles_sync.env import CPU_SHIM_VARIABLE, ENGINE_ADMIN_API_KEY_VARIABLE, ENGINE_API_KEY_VARIABLE
from miles_sync.wire.draft import DraftKind

HOST = "127.0.0.1"
API_KEY = "rollout-key-0123"
ADMIN_KEY = "admin-key-4567"
LORA = LoraSettings(max_rank=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))


@pytest.fixture(scope="module")
def flags() -> ServerFlags:
    return vendored_server_flags()


def _server_args(argv: tuple[str, ...]) -> list[str]:
    """SGLang's own arguments: what follows the entry point that hands it its keys."""
    assert argv[:3] == (sys.executable, "-m", SGLANG_LAUNCH_MODULE)
    return list(argv[3:])


BASE = {"host": HOST, "model_path": "/ckpt/target", "tp_size": 1}
CHAIN_3 = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}

CASES = {
    "no speculative decoding": (dict(model_path="/ckpt/target"), BASE),
    "tp 4": (dict(model_path="/ckpt/target", tp_size=4), {**BASE, "tp_size": 4}),
    "NEXTN over the target's MTP layers": (
        dict(model_path="/ckpt/target", speculative_algorithm="NEXTN", draft_kind=DraftKind.MTP),
        {
            **BASE,
            "speculative_algorithm": "NEXTN",
            "speculative_draft_model_path": "/ckpt/target",
            **CHAIN_3,
        },
    ),
    "eagle (lower case) over MTP layers, 2 steps, tp 2": (
        dict(model_path="/ckpt/t", tp_size=2, speculative_algorithm="eagle", draft_kind="mtp", spec_steps=2),
        {
            **BASE,
            "model_path": "/ckpt/t",
            "tp_size": 2,
            "speculative_algorithm": "EAGLE",
            "speculative_draft_model_path": "/ckpt/t",
            "speculative_num_steps": 2,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 3,
        },
    ),
    "EAGLE3 head": (
        dict(
            model_path="/ckpt/target",
            speculative_algorithm="EAGLE3",
            draft_kind=DraftKind.STANDALONE,
            draft_model_path="/ckpt/eagle3",
        ),
        {**BASE, "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/ckpt/eagle3", **CHAIN_3},
    ),
    "STANDALONE draft model, 5 steps": (
        dict(
            model_path="/ckpt/target",
            speculative_algorithm="STANDALONE",
            draft_kind=DraftKind.STANDALONE,
            draft_model_path="/ckpt/small",
            spec_steps=5,
        ),
        {
            **BASE,
            "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": "/ckpt/small",
            "speculative_num_steps": 5,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 6,
        },
    ),
    "NGRAM": (
        dict(model_path="/ckpt/target", speculative_algorithm="NGRAM", draft_kind=DraftKind.NGRAM),
        {**BASE, "speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
    ),
    "LoRA adapters loaded later": (
        dict(model_path="/ckpt/target", lora=LORA),
        {
            **BASE,
            "enable_lora": True,
            "max_lora_rank": 16,
            "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        },
    ),
    "LoRA with every option, NEXTN": (
        dict(
            model_path="/ckpt/target",
            speculative_algorithm="NEXTN",
            draft_kind=DraftKind.MTP,
            lora=LoraSettings(max_rank=8, target_modules=("all",), max_loras_per_batch=2, max_loaded_loras=4),
        ),
        {
            **BASE,
            "speculative_algorithm": "NEXTN",
            "speculative_draft_model_path": "/ckpt/target",
            **CHAIN_3,
            "enable_lora": True,
            "max_lora_rank": 8,
            "lora_target_modules": ["all"],
            "max_loras_per_batch": 2,
            "max_loaded_loras": 4,
        },
    ),
    "extra args after the built ones": (
        dict(model_path="/ckpt/target", extra_args=("--mem-fraction-static", "0.7", "--enable-memory-saver")),
        {**BASE, "mem_fraction_static": 0.7, "enable_memory_saver": True},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_flag_of_the_command_is_sglangs_and_carries_the_settings(case, flags):
    kwargs, expected = CASES[case]
    command = SGLangEngineSpec(**kwargs).command(host=HOST)
    parsed = parse_server_args(flags, _server_args(command.argv))
    port = parsed.pop("port")
    assert parsed == expected
    assert command.url == f"http://{HOST}:{port}" and 0 < port < 65536
    assert command.env == {}


def test_the_keys_reach_sglangs_arguments_only_inside_its_process(flags):
    spec = SGLangEngineSpec(model_path="/ckpt/target", api_key=API_KEY, admin_api_key=ADMIN_KEY)
    command = spec.command(host=HOST)
    assert not any(API_KEY in a or ADMIN_KEY in a for a in command.argv)  # /proc/PID/cmdline is world-readable
    assert command.env == {ENGINE_API_KEY_VARIABLE: API_KEY, ENGINE_ADMIN_API_KEY_VARIABLE: ADMIN_KEY}
    assert API_KEY not in repr(command) and ADMIN_KEY not in repr(spec)
    environ = {**command.env, "OTHER": "kept"}
    args = server_argv(_server_args(command.argv), environ)  # what the entry point hands SGLang
    parsed = parse_server_args(flags, args)
    assert parsed["api_key"] == API_KEY and parsed["admin_api_key"] == ADMIN_KEY
    assert environ == {"OTHER": "kept"}  # SGLang's worker processes inherit no key


def test_the_entry_point_refuses_a_key_on_the_command_line():
    with pytest.raises(ValueError, match="--api-key on the command line"):
        server_argv(["--model-path", "m", "--api-key=k"], {})
    assert server_argv(["--model-path", "m"], {}) == ["--model-path", "m"]


def test_the_host_is_the_callers_node_address():
    command = SGLangEngineSpec(model_path="m").command(host="127.0.0.3")  # a node address in a simulated cluster
    args = _server_args(command.argv)
    assert args[args.index("--host") + 1] == "127.0.0.3" and command.url.startswith("http://127.0.0.3:")
    v6 = SGLangEngineSpec(model_path="m").command(host="::1")
    assert v6.url.startswith("http://[::1]:")


def test_the_settings_reach_the_spec():
    settings = EngineSettings(
        model_dir="/ckpt/t",
        speculative_algorithm="EAGLE3",
        draft_kind=DraftKind.STANDALONE,
        draft_dir="/ckpt/d",
        spec_steps=4,
        tp_size=2,
        api_key=API_KEY,
        lora=LORA,
    )
    spec = engine_spec(EngineKind.SGLANG, settings)
    assert spec == SGLangEngineSpec(
        model_path="/ckpt/t",
        tp_size=2,
        speculative_algorithm="EAGLE3",
        draft_kind=DraftKind.STANDALONE,
        draft_model_path="/ckpt/d",
        spec_steps=4,
        lora=LORA,
        api_key=API_KEY,
    )


def test_the_config_reaches_the_command(flags):
    config = MilesSyncConfig(
        model=ModelConfig(speculative_algorithm="NEXTN"),
        engines=EngineConfig(kind=EngineKind.SGLANG, tp=2, draft_kind=DraftKind.MTP, spec_steps=2),
    )
    settings = config.engines.launch_settings(
        model_dir="/ckpt/t", speculative_algorithm=config.model.speculative_algorithm, lora=LORA
    )
    parsed = parse_server_args(flags, _server_args(engine_spec(config.engines.kind, settings).command(host=HOST).argv))
    assert parsed["tp_size"] == 2 and parsed["speculative_algorithm"] == "NEXTN"
    assert parsed["speculative_num_steps"] == 2 and parsed["speculative_num_draft_tokens"] == 3
    assert parsed["max_lora_rank"] == 16


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(tp_size=0, spec_steps=0), "tp_size=0 must be at least 1; spec_steps=0 must be at least 1"),
        (dict(speculative_algorithm="MTP", draft_kind="mtp"), "'MTP' has no SGLang launch mapping here; use one of"),
        (dict(speculative_algorithm="NEXTN", draft_kind="standalone", draft_model_path="d"), "runs draft_kind 'mtp'"),
        (dict(speculative_algorithm="EAGLE3", draft_kind="mtp"), "runs draft_kind 'standalone', not 'mtp'"),
        (dict(speculative_algorithm="NGRAM", draft_kind="none"), "runs draft_kind 'ngram', not 'none'"),
        (dict(draft_kind="mtp"), "draft_kind='mtp' needs a speculative_algorithm"),
        (dict(speculative_algorithm="EAGLE", draft_kind="standalone"), "'standalone' needs draft_model_path"),
        (dict(draft_model_path="d"), "draft_model_path='d' applies to draft_kind 'standalone' only"),
        (
            dict(speculative_algorithm="STANDALONE", draft_kind="standalone", draft_model_path="d", lora=LORA),
            "SGLang serves LoRA adapters with speculative_algorithm EAGLE, EAGLE3, NEXTN, NGRAM or none",
        ),
        (dict(api_key=""), "api_key must be None or a non-empty string"),
        (dict(admin_api_key=ADMIN_KEY), "admin_api_key needs api_key as well"),
        (dict(extra_args=("--tp-size", "2")), "extra_args repeat flags built here: --tp-size"),
        (dict(extra_args=("--api-key=k", "--model", "x")), "repeat flags built here: --api-key, --model"),
    ],
)
def test_what_sglang_would_refuse_is_refused_naming_it(kwargs, expected):
    with pytest.raises(ValueError, match="invalid SGLangEngineSpec: .*" + re.escape(expected)):
        SGLangEngineSpec(model_path="m", **kwargs)


def test_lora_settings_follow_sglangs_rules():
    with pytest.raises(ValueError, match=r"max_rank=0 must be at least 1; target_modules=\[\] must name"):
        LoraSettings(max_rank=0, target_modules=())
    with pytest.raises(ValueError, match="'all' must be the only module"):
        LoraSettings(max_rank=8, target_modules=("all", "q_proj"))
    with pytest.raises(ValueError, match=r"max_loaded_loras=2 must be at least max_loras_per_batch \(8\)"):
        LoraSettings(max_rank=8, target_modules=("q_proj",), max_loaded_loras=2)


def test_lora_target_modules_are_sglangs(flags):
    choices = flags.flags["--lora-target-modules"].choices
    assert choices is not None and set(LORA.target_modules) <= set(choices) and "all" in choices


def test_an_sglang_config_with_an_unlaunchable_draft_fails_at_load():
    with pytest.raises(ValueError, match="engines.kind=sglang: speculative_algorithm='MTP' has no SGLang"):
        MilesSyncConfig(
            model=ModelConfig(speculative_algorithm="MTP"),
            engines=EngineConfig(kind=EngineKind.SGLANG, draft_kind=DraftKind.MTP),
        )
    assert sglang_speculative_problems(speculative_algorithm="nextn", draft_kind="mtp") == []
    # Running servers given by URL are not launched here: their flags are the operator's.
    MilesSyncConfig(
        model=ModelConfig(speculative_algorithm="MTP"),
        engines=EngineConfig(kind=EngineKind.SGLANG, draft_kind=DraftKind.MTP, count=1, urls=("http://h:1",)),
    )


def test_the_vendored_flags_are_what_sglangs_source_declares(flags, sglang_source):
    source = sglang_source(flags.sglang_version)
    derived = derive_server_flags(source)
    assert derived.sglang_version == flags.sglang_version
    changed = sorted(o for o in derived.flags.keys() | flags.flags.keys() if derived.flags.get(o) != flags.flags.get(o))
    assert not changed, f"re-derive tests/data/sglang_server_flags.json from {source}; changed: {changed[:20]}"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--speculative-num-step", "3"], "not SGLang 0.5.23 flags: ['--speculative-num-step']"),
        (["--speculative-eagle", "1"], "not SGLang 0.5.23 flags"),  # an abbreviation SGLang's parser would expand
        (["--tp-size", "two"], "argument --tp-size: invalid int value: 'two'"),
        (["--tp-size"], "argument --tp-size: expected one argument"),
        (["--lora-target-modules", "qproj"], "argument --lora-target-modules: invalid choice: 'qproj'"),
        (["--enable-lora", "yes"], "unrecognized arguments: yes"),
        (["--tp-size", "1", "--tp-size", "2"], "a flag is given twice"),
        (["--sampling-backend", "pytorch"], "choices of ['--sampling-backend'] are computed at SGLang's start"),
    ],
)
def test_the_check_refuses_what_sglangs_parser_would(flags, args, expected):
    with pytest.raises(ServerArgsError, match=re.escape(expected)):
        parse_server_args(flags, ["--model-path", "m", *args])


def test_a_cpu_server_gets_the_cpu_flags_its_own_python_and_one_core_per_rank(flags):
    spec = SGLangEngineSpec(model_path="/ckpt/target", tp_size=2, device="cpu", python="/venvs/sglang/bin/python")
    command = spec.command(host=HOST)
    assert command.argv[:3] == ("/venvs/sglang/bin/python", "-m", SGLANG_LAUNCH_MODULE)
    args = list(command.argv[3:])
    # --sampling-backend's choices are computed at SGLang's start (the vendored parser cannot check them).
    at = args.index("--sampling-backend")
    assert args[at + 1] == "pytorch"
    del args[at : at + 2]
    parsed = parse_server_args(flags, args)  # every other CPU flag is one SGLang 0.5.23 parses
    parsed.pop("port")
    assert parsed == {
        **BASE,
        "tp_size": 2,
        "device": "cpu",
        "attention_backend": "torch_native",
        "grammar_backend": "none",
        "cuda_graph_backend_decode": "disabled",
        "cuda_graph_backend_prefill": "disabled",
        "skip_server_warmup": True,
        "dtype": "float32",
        "mem_fraction_static": 0.1,
        "max_total_tokens": "4096",  # the vendored parser keeps a value whose field type it cannot read
        "sleep_on_idle": True,  # an idle scheduler blocks on its sockets instead of polling them
    }
    assert command.env == cpu_environment(2) and command.env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert command.env[CPU_SHIM_VARIABLE] == "1"
    assert cpu_environment(3, num_cores=2)["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1|0"
    # A GPU server names its device and nothing else of the CPU set.
    gpu = SGLangEngineSpec(model_path="/ckpt/target", device="cuda").command(host=HOST)
    assert parse_server_args(flags, _server_args(gpu.argv))["device"] == "cuda" and gpu.env == {}
