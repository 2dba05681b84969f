"""Bridge-mode export in a real two-process gloo group on 127.0.0.1.

One spawned group runs every case (imports are paid once) and reports, per case, the mismatches it found; the
tests below assert that each list is empty. Cases: Llama, Qwen2 and Qwen3 at TP=1 and TP=2 (plus PP=2 and a tied
Qwen2), each on
- a model megatron-bridge builds from an HF checkpoint directory: exported tensors equal the checkpoint's and the
  raw gather's on the same model, bit for bit, with the same atomic units;
- a model miles_sync's own builder makes (vocabulary padded, weights perturbed): bridge and raw streams are equal.
The Transformer Engine import shim is checked in the same processes: megatron-core kept its TE-free paths and
every use of a placeholder raises.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

# Slow as a module: export parity over the parallel matrix in gloo processes (this file and its bridge or raw
# twin take about a minute together). The unit tier covers the conversion rules without processes.
pytestmark = pytest.mark.slow


WORLD_SIZE = 2
TIMEOUT_S = 240.0
HOST = "127.0.0.1"


@dataclass(frozen=True, kw_only=True)
class Case:
    arch: str
    tp: int = 1
    pp: int = 1
    tie: bool = False

    @property
    def id(self) -> str:
        return f"{self.arch}-tp{self.tp}-pp{self.pp}" + ("-tied" if self.tie else "")


CASES = (
    *(Case(arch=arch, tp=tp) for arch in ("llama", "qwen2", "qwen3") for tp in (1, 2)),
    Case(arch="llama", pp=2),
    Case(arch="qwen2", tp=2, tie=True),
)


# ---------------------------------------------------------------------------------------------------------------
# Worker side (spawned processes).
# ---------------------------------------------------------------------------------------------------------------


def _hf_config(case: Case):
    import transformers

    common = dict(
        vocab_size=250,  # not a multiple of 128: the builder's model carries vocabulary padding
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=case.tie,
    )
    if case.arch == "llama":
        return transformers.LlamaConfig(**common)
    if case.arch == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.Qwen3Config(**common, head_dim=16)  # Qwen3Config defaults head_dim to 128


def _write_checkpoint(case: Case, out_dir: Path) -> None:
    import torch
    import transformers

    config = _hf_config(case)
    torch.manual_seed(len(case.id))
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Norms start at one and biases at zero: random values make a swapped or dropped tensor visible.
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.05)
    model.save_pretrained(str(out_dir), safe_serialization=True)


def _compare_units(got, want, *, label: str) -> list[str]:
    """Mismatches between two unit streams, compared per unit key (meta and tensors bit for bit)."""
    import torch

    got_by_key = {u.meta.key: u for u in got}
    want_by_key = {u.meta.key: u for u in want}
    problems = [f"{label}: unit {k} only in bridge" for k in got_by_key.keys() - want_by_key.keys()]
    problems += [f"{label}: unit {k} missing from bridge" for k in want_by_key.keys() - got_by_key.keys()]
    for key in got_by_key.keys() & want_by_key.keys():
        g, w = got_by_key[key], want_by_key[key]
        if g.meta != w.meta:
            problems.append(f"{label}: unit {key} meta {g.meta} != {w.meta}")
        elif (g.tensors is None) != (w.tensors is None):
            problems.append(f"{label}: unit {key} tensors present in one stream only")
        elif g.tensors is not None:
            for meta, a, b in zip(g.meta.tensors, g.tensors, w.tensors, strict=True):
                if not torch.equal(a, b):
                    problems.append(f"{label}: {meta.name} differs")
    return sorted(problems)


def _check_against_checkpoint(units, checkpoint: Path) -> tuple[list[str], list[str]]:
    """(mismatches, exported names) of one stage's stream against the checkpoint it was loaded from."""
    import torch
    from safetensors.torch import load_file

    want = load_file(str(checkpoint / "model.safetensors"))
    got = {name: t for u in units for name, t in u.named()}
    problems = [f"checkpoint: {n} not in checkpoint" for n in sorted(got.keys() - want.keys())]
    both = sorted(want.keys() & got.keys())
    problems += [f"checkpoint: {n} differs" for n in both if not torch.equal(got[n], want[n])]
    return problems, sorted(got)


def _run_case(case: Case, workdir: Path) -> dict[str, list[str]]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from miles_sync.export import bridge
    from miles_sync.export.megatron import is_export_source, iter_hf_units
    from miles_sync.export.raw import create_converter
    from miles_sync.megatron.model_builder import build_gpt_model

    checkpoint = workdir / case.id
    if dist.get_rank() == 0:
        _write_checkpoint(case, checkpoint)
    dist.barrier()
    ps.initialize_model_parallel(tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp)
    try:
        found: dict[str, list[str]] = {}
        auto_bridge = bridge.load_bridge(checkpoint)
        hf_config = auto_bridge.hf_pretrained.config
        converter = create_converter(case.arch, hf_config)

        # A model the bridge builds and loads from the checkpoint.
        model = bridge.build_bridge_model(auto_bridge)
        exporter = bridge.BridgeExporter(auto_bridge, model)
        units = list(exporter.iter_units())
        found["metadata"] = [] if [u.meta for u in units] == exporter.metadata() else ["metadata() != stream"]
        found["raw"] = _compare_units(units, list(iter_hf_units(model, converter=converter)), label="bridge-built")
        if is_export_source():
            found["checkpoint"], found["exported"] = _check_against_checkpoint(units, checkpoint)
            found["source"] = [] if all(u.tensors is not None for u in units) else ["source rank lacks tensors"]
        else:
            found["source"] = [] if all(u.tensors is None for u in units) else ["non-source rank holds tensors"]
        if dist.get_rank() == 0:
            from safetensors import safe_open

            with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
                found["checkpoint_names"] = sorted(f.keys())

        # A model built by miles_sync's own builder: padded vocabulary, weights that never were a checkpoint.
        torch.manual_seed(7)
        own = build_gpt_model(hf_config)
        with torch.no_grad():
            for param in own.parameters():
                param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
        found["builder"] = _compare_units(
            list(bridge.iter_hf_units(own, hf_config=hf_config)),
            list(iter_hf_units(own, converter=converter)),
            label="builder model",
        )
        dist.barrier()
        return found
    finally:
        ps.destroy_model_parallel()


def _check_te_shim() -> dict[str, list[str]]:
    import importlib.util
    import sys

    from miles_sync.megatron import te_shim

    problems = []
    if not te_shim.is_shim_installed():
        return {"te_shim": ["the shim is not installed on a CPU machine"]}
    seeing_te = sorted(
        m
        for m, mod in list(sys.modules.items())
        if m.startswith("megatron.core") and getattr(mod, "HAVE_TE", False) is True
    )
    import transformer_engine.pytorch as te

    for label, use in (
        ("construct", lambda: te.Linear(4, 4)),
        ("class attribute", lambda: te.Linear.forward),
        ("subclass", lambda: type("Sub", (te.Linear,), {})()),
    ):
        try:
            use()
            problems.append(f"{label}: a placeholder did not raise")
        except te_shim.TransformerEngineUnavailableError as e:
            if "Transformer Engine" not in str(e):
                problems.append(f"{label}: unclear message {e}")
    try:
        from transformer_engine.pytorch import LayerNormMLP  # noqa: F401

        problems.append("an unlisted name imported")
    except ImportError:
        pass
    if importlib.util.find_spec("transformer_engine") is None:
        problems.append("find_spec does not see the registered placeholder")
    return {"te_shim": problems, "have_te": seeing_te}


def _worker(rank: int, port: int, workdir: str) -> None:
    from miles_sync.env import adopt_bind_host

    adopt_bind_host(HOST)  # this process's groups bind loopback
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    out = Path(workdir)
    try:
        timeout = timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timeout)
        from miles_sync.export.bridge import prepare_megatron_bridge

        prepare_megatron_bridge()
        results = {"shim": _check_te_shim()}
        for case in CASES:
            results[case.id] = _run_case(case, out)
        (out / f"results.rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()
    except BaseException:
        (out / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise


# ---------------------------------------------------------------------------------------------------------------
# Test side.
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    import torch.distributed as dist

    workdir = tmp_path_factory.mktemp("bridge")
    store = dist.TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_worker, args=(r, store.port, str(workdir)), daemon=True) for r in range(WORLD_SIZE)
    ]
    for p in processes:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in processes):
                break
            time.sleep(0.1)
    finally:
        for p in processes:
            if p.is_alive():
                p.terminate()
            p.join(10)
    errors = "\n".join(e.read_text() for e in sorted(workdir.glob("error.rank*.txt")))
    if errors or any(p.exitcode != 0 for p in processes):
        pytest.fail(f"bridge export workers failed (exit codes {[p.exitcode for p in processes]}):\n{errors}")
    return [json.loads((workdir / f"results.rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def _problems(results: list[dict], case_id: str, check: str) -> list[str]:
    return [f"rank {r}: {p}" for r, res in enumerate(results) for p in res[case_id].get(check, [])]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bridge_export_equals_checkpoint(results, case):
    # Each stage's source rank exports its own stage; together they cover the checkpoint exactly once.
    exported = [name for res in results for name in res[case.id].get("exported", [])]
    assert sorted(exported) == results[0][case.id]["checkpoint_names"]
    assert _problems(results, case.id, "checkpoint") == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bridge_export_equals_raw_on_bridge_built_model(results, case):
    assert _problems(results, case.id, "raw") == []
    assert _problems(results, case.id, "metadata") == []
    assert _problems(results, case.id, "source") == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bridge_export_equals_raw_on_builder_model(results, case):
    assert _problems(results, case.id, "builder") == []


def test_te_shim_placeholders_compute_nothing(results):
    assert [p for res in results for p in res["shim"]["te_shim"]] == []


def test_te_shim_leaves_megatron_core_flags_as_without_it(results):
    # Some megatron-core modules set HAVE_TE from names megatron-core itself defines (multi_latent_attention does
    # even without any shim); the shim must not add to them. Baseline: the same modules imported in a fresh
    # process that never sees the shim.
    with_shim = sorted({m for res in results for m in res["shim"]["have_te"]})
    code = (
        "import importlib, sys, warnings; warnings.filterwarnings('ignore'); mods = sys.argv[1:]\n"
        "for m in mods: importlib.import_module(m)\n"
        "assert 'transformer_engine' not in sys.modules\n"
        "print(' '.join(m for m in mods if getattr(sys.modules[m], 'HAVE_TE', False) is True))"
    )
    baseline = subprocess.run([sys.executable, "-c", code, *with_shim], capture_output=True, text=True, timeout=180)
    assert baseline.returncode == 0, baseline.stderr[-2000:]
    assert with_shim == sorted(baseline.stdout.split())
