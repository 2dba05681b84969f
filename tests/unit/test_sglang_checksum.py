"""SGLang's checker arithmetic (miles_sync.weights.checksum.sglang_*), against values written out from SGLang's
source."""

from __future__ import annotations

import hashlib

import torch

from miles_sync.weights.checksum import (
    sglang_engine_checksum,
    sglang_overall_checksum,
    sglang_parameter_names,
    sglang_reported_name,
    sglang_tensor_hash,
)


def test_parameter_names_fuse_qkv_and_gate_up_only_when_every_part_is_there():
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.bias",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",  # no v: not fused
        "model.layers.0.self_attn.o_proj.weight",
        "lm_head.weight",
        "xself_attn.q_proj.weight",
    ]
    assert sglang_parameter_names(names) == {
        "model.layers.0.self_attn.qkv_proj.weight": tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"),
        "model.layers.0.self_attn.qkv_proj.bias": tuple(f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"),
        "model.layers.0.mlp.gate_up_proj.weight": (
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
        ),
        "model.layers.1.self_attn.q_proj.weight": ("model.layers.1.self_attn.q_proj.weight",),
        "model.layers.1.self_attn.k_proj.weight": ("model.layers.1.self_attn.k_proj.weight",),
        "model.layers.0.self_attn.o_proj.weight": ("model.layers.0.self_attn.o_proj.weight",),
        "lm_head.weight": ("lm_head.weight",),
        "xself_attn.q_proj.weight": ("xself_attn.q_proj.weight",),
    }


def test_tensor_hash_is_sglangs_cpu_tensor_hash():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    raw = t.numpy().tobytes()
    expected = int.from_bytes(hashlib.sha256(raw).digest()[:8], byteorder="big", signed=False)
    assert sglang_tensor_hash(t) == f"{expected:016x}"
    # Raw bytes only: a reinterpretation of the same bytes hashes the same (unlike tensor_checksum).
    assert sglang_tensor_hash(t.view(torch.int32)) == sglang_tensor_hash(t.reshape(4, 3))
    assert sglang_tensor_hash(t.t()) != sglang_tensor_hash(t)  # contiguous copy of the transpose: other bytes


def test_overall_and_engine_checksums_and_role_prefix():
    checksums = {"b": "00000000000000ff", "a": "0123456789abcdef"}
    h = hashlib.sha256()
    for part in ("a", "0123456789abcdef", "b", "00000000000000ff"):
        h.update(part.encode())
    assert sglang_overall_checksum(checksums) == h.hexdigest()
    per_engine = hashlib.sha256(b"x" + b"y").hexdigest()
    assert sglang_engine_checksum(["x", "y"]) == per_engine != sglang_engine_checksum(["y", "x"])
    assert sglang_reported_name("target", "w") == "w"
    assert sglang_reported_name("draft", "w") == "draft.w"
    assert sglang_reported_name("draft_step_0", "w") == "draft_step_0.w"
