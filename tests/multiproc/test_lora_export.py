"""LoRA on megatron-core across real gloo groups: TP-aware adapters, the base frozen, export into PEFT names.

One group of two spawned processes runs three layouts (TP=2; PP=2; TP=1 x DP=2) of the reference checkpoint with
the same adapter (A from the seed, B filled from a seed per canonical module, split as the layer is):
- the exported PEFT tensors are bit-identical across layouts, with PEFT's names and shapes;
- applying them to the transformers model (an equivalent merge, W + alpha/r * B A; `peft` is not installed here)
  gives the megatron model's logits within LOGIT_TOLERANCE (float32);
- one optimizer step over the adapters changes the adapters and leaves every base parameter bit-identical; the
  halves every TP rank holds whole (column A, row B) stay equal across ranks (their gradients are the full ones).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

LOGIT_TOLERANCE = 1e-4
SPEC = dict(
    rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)
LAYOUTS = ((2, 1), (1, 2), (1, 1))  # (tp, pp) over 2 processes; (1, 1) is dp=2
TIMEOUT_S = 240.0


def _fill_b(chunks, adapters, tp_rank: int, tp_size: int) -> None:
    """B from a seed per canonical module name, the full tensor split as the layer is (column: rows)."""
    from miles_sync.export.stage import collect_local_params

    canonical = {(p.chunk, p.local_name): p.canonical for p in collect_local_params(chunks)}
    with torch.no_grad():
        for chunk, path, adapter in adapters.items():
            name = canonical[(chunk, f"{path}.weight")]
            seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
            rows = adapter.lora_b.shape[0] * (1 if adapter.is_row_parallel else tp_size)
            full = torch.randn(rows, adapter.lora_b.shape[1], generator=torch.Generator().manual_seed(seed)) * 0.2
            if path.endswith("linear_fc1"):  # megatron keeps [gate shard; up shard] on each rank
                full = torch.cat([half.chunk(tp_size, dim=0)[tp_rank] for half in full.chunk(2, dim=0)])
            elif not adapter.is_row_parallel:  # q/k/v: per query group, so contiguous rows per rank
                full = full.chunk(tp_size, dim=0)[tp_rank]
            adapter.lora_b.copy_(full)


def _worker(rank: int, port: int, checkpoint: str, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    try:
        import transformers
        from megatron.core import parallel_state as ps

        from miles_sync.export.loader import load_hf_checkpoint
        from miles_sync.export.lora import gather_peft_adapter
        from miles_sync.export.megatron import model_chunks
        from miles_sync.export.raw import create_converter
        from miles_sync.megatron.forward import megatron_logits
        from miles_sync.megatron.lora import LoraSpec, apply_lora
        from miles_sync.megatron.model_builder import build_gpt_model

        hf_config = transformers.AutoConfig.from_pretrained(checkpoint)
        converter = create_converter(hf_config.model_type, hf_config)
        input_ids = torch.randint(0, hf_config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
        for tp, pp in LAYOUTS:
            ps.initialize_model_parallel(tp, pp)
            model = build_gpt_model(hf_config, mtp_num_layers=0)
            load_hf_checkpoint(model, checkpoint, converter=converter)
            chunks = model_chunks(model)
            adapters = apply_lora(chunks, LoraSpec(**SPEC), seed=0)
            tp_rank = ps.get_tensor_model_parallel_rank()
            _fill_b(chunks, adapters, tp_rank, tp)
            named = gather_peft_adapter(chunks, adapters, converter=converter)
            logits = megatron_logits(model, input_ids, timeout_s=TIMEOUT_S)
            result: dict = {"adapter": named}
            if logits is not None and tp_rank == 0 and ps.get_data_parallel_rank() == 0:
                result["logits"] = logits[..., : hf_config.vocab_size].clone()
            # One step over the adapters only: the base must not move.
            base = {n: p.detach().clone() for n, p in model.named_parameters()}
            before = {n: p.detach().clone() for n, p in adapters.named_parameters()}
            optimizer = torch.optim.SGD(adapters.parameters(), lr=0.1)
            if pp == 1:  # a plain forward/backward (the pipeline schedule is the trainer's, tested there)
                model.train()
                position_ids = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
                logits_train = model(input_ids, position_ids, None)
                logits_train.float().pow(2).mean().backward()
                optimizer.step()
                result["base_unchanged"] = all(torch.equal(base[n], p) for n, p in model.named_parameters())
                result["adapters_changed"] = any(not torch.equal(before[n], p) for n, p in adapters.named_parameters())
                result["base_grads"] = [n for n, p in model.named_parameters() if p.grad is not None]
                # Replicated halves (column A, row B) must stay equal on every TP rank after the step.
                result["replicated"] = {
                    path: (a.lora_b if a.is_row_parallel else a.lora_a).detach().clone()
                    for _, path, a in adapters.items()
                }
            torch.save(result, Path(out_dir) / f"tp{tp}-pp{pp}.rank{rank}.pt")
            ps.destroy_model_parallel()
            dist.barrier()
    except BaseException:
        (Path(out_dir) / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(reference_checkpoints, tmp_path_factory) -> Path:
    import socket

    out = tmp_path_factory.mktemp("lora_export")
    with socket.socket() as s:  # a free port for the group's store (rank 0 hosts it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    checkpoint = str(reference_checkpoints / "target")
    processes = [context.Process(target=_worker, args=(r, port, checkpoint, str(out)), daemon=True) for r in (0, 1)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(TIMEOUT_S)
    errors = "\n".join(e.read_text() for e in sorted(out.glob("error.rank*.txt")))
    for p in processes:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in processes), f"workers failed: {[p.exitcode for p in processes]}\n{errors}"
    return out


def _load(out: Path, tp: int, pp: int) -> tuple[dict, dict]:
    ranks = [torch.load(out / f"tp{tp}-pp{pp}.rank{r}.pt") for r in (0, 1)]
    adapter = next(r["adapter"] for r in ranks if r["adapter"])
    logits = next(r["logits"] for r in ranks if "logits" in r)
    return adapter, {"logits": logits, "ranks": ranks}


def test_exported_adapter_is_peft_named_identical_across_layouts_and_gives_megatrons_logits(
    results, reference_checkpoints
):
    import transformers

    reference, _ = _load(results, 1, 1)
    config = transformers.AutoConfig.from_pretrained(reference_checkpoints / "target")
    layers, hidden = config.num_hidden_layers, config.hidden_size
    kv = config.num_key_value_heads * config.head_dim
    expected_b_rows = {"q_proj": config.num_attention_heads * config.head_dim, "k_proj": kv, "v_proj": kv}
    expected_b_rows |= {"o_proj": hidden, "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    expected_b_rows |= {"down_proj": hidden}
    assert len(reference) == layers * 7 * 2
    for name, tensor in reference.items():
        module = name.removeprefix("base_model.model.").rsplit(".", 2)[0]
        leaf = module.rsplit(".", 1)[-1]
        assert name.startswith("base_model.model.model.layers.") and name.endswith((".lora_A.weight", ".lora_B.weight"))
        in_features = config.num_attention_heads * config.head_dim if leaf == "o_proj" else hidden
        in_features = config.intermediate_size if leaf == "down_proj" else in_features
        want = (SPEC["rank"], in_features) if "lora_A" in name else (expected_b_rows[leaf], SPEC["rank"])
        assert tuple(tensor.shape) == want, name
    for tp, pp in LAYOUTS:
        adapter, _ = _load(results, tp, pp)
        assert adapter.keys() == reference.keys()
        different = [n for n in reference if not torch.equal(adapter[n], reference[n])]
        assert not different, f"tp{tp} pp{pp}: {different[:4]}"

    # transformers with the adapter merged into the adapted weights
    model = transformers.AutoModelForCausalLM.from_pretrained(reference_checkpoints / "target", dtype=torch.float32)
    modules = dict(model.named_modules())
    scale = SPEC["alpha"] / SPEC["rank"]
    with torch.no_grad():
        for name, a in reference.items():
            if ".lora_A." in name:
                module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                modules[module].weight += scale * (reference[name.replace("lora_A", "lora_B")] @ a)
    input_ids = torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf_logits = model(input_ids).logits
    for tp, pp in LAYOUTS:
        _, rest = _load(results, tp, pp)
        error = (rest["logits"] - hf_logits).abs().max().item()
        assert error < LOGIT_TOLERANCE, f"tp{tp} pp{pp}: max logit error {error}"


def test_a_step_over_the_adapters_leaves_the_base_bit_identical(results):
    for tp, pp in LAYOUTS:
        if pp > 1:
            continue
        ranks = torch_ranks(results, tp, pp)
        for rank in ranks:
            assert rank["base_unchanged"] and rank["adapters_changed"] and rank["base_grads"] == []
        first, second = (r["replicated"] for r in ranks)
        assert all(torch.equal(first[path], second[path]) for path in first), f"tp{tp}: replicas diverged"


def torch_ranks(out: Path, tp: int, pp: int) -> list[dict]:
    return [torch.load(out / f"tp{tp}-pp{pp}.rank{r}.pt") for r in (0, 1)]
