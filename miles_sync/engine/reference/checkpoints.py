"""Deterministic reference checkpoints: a Qwen3-style target with one MTP layer, and a smaller standalone draft.

    python -m miles_sync.engine.reference.checkpoints --out DIR [--seed S] [--threads T]

writes DIR/target and DIR/draft (config.json, model.safetensors, recipe.json, and a byte-level tokenizer: token id
= byte value, so `text` prompts work). Both are pre-trained on CPU in about
a minute on a synthetic language: x_{t+1} = (a * x_t + c) mod vocab, with a small share of uniformly random tokens.
With a = 5 and c = 17 the map is a single cycle over all 256 tokens (Hull-Dobell), so greedy continuations are long
and non-repeating (an n-gram draft finds nothing to look up), every token is seen in training, and an intact draft
agrees with the target almost always while a corrupted one almost never does. The target and its MTP head train
jointly (LM loss + mtp_weight x MTP loss), as DeepSeek-V3 and Megatron train MTP.

Same recipe and seed -> same bytes: all randomness comes from seeded generators and the thread count is fixed.

Built-in architectures (`BUILT_IN_ARCHS`): "qwen3", the dense target and draft above (`CheckpointRecipe`), and
"qwen3_moe", a tiny Qwen3-MoE target with one MTP layer (`MoeCheckpointRecipe`: 4 experts, top-2), trained the same
way on the same language; it has no standalone draft. Each is cached in its own directory, named by its recipe
digest (`cached_checkpoints(cache_dir, arch=...)`).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from miles_sync.engine.reference.models import CausalLM, MTPHead, model_family

__all__ = ["BUILT_IN_ARCHS", "LanguageRecipe", "cached_checkpoints", "next_token"]

# Bump when the training code changes in a way that changes the bytes, so cached checkpoints are rebuilt.
_FORMAT_VERSION = 3


@dataclass(frozen=True, kw_only=True)
class LanguageRecipe:
    vocab_size: int = 256
    multiplier: int = 5
    increment: int = 17
    noise: float = 0.05  # share of uniformly random tokens

    def __post_init__(self) -> None:
        if self.vocab_size < 2 or not 0 <= self.noise < 1:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 2 and noise={self.noise} in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 32


@dataclass(frozen=True, kw_only=True)
class CheckpointRecipe:
    """Everything that determines the checkpoint bytes (with the torch/transformers versions)."""

    seed: int = 0
    language: LanguageRecipe = field(default_factory=LanguageRecipe)
    # float32 keeps the AITER shuffle far from an involution for these widths (order 5..51, see layout.py).
    target: ModelShape = field(
        default_factory=lambda: ModelShape(
            hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        )
    )
    # Narrower than the target, so target tensors selected into the draft conflict by shape instead of loading.
    # Two attention heads (one KV head, replicated) so the draft also runs at TP=2.
    draft: ModelShape = field(
        default_factory=lambda: ModelShape(
            hidden_size=96, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
        )
    )
    dtype: str = "float32"
    target_steps: int = 60  # the LM and MTP losses reach the language's entropy floor (~0.48) by step ~40
    draft_steps: int = 60
    batch_size: int = 32
    seq_len: int = 64
    lr: float = 2e-3
    mtp_weight: float = 0.3
    log_every: int = 20

    def __post_init__(self) -> None:
        problems = [
            f"{name}={getattr(self, name)} must be positive"
            for name in ("target_steps", "draft_steps", "batch_size", "seq_len", "log_every")
            if getattr(self, name) <= 0
        ]
        if self.seq_len < 3:
            problems.append(f"seq_len={self.seq_len} must be at least 3 (the MTP head predicts two tokens ahead)")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class MoeShape:
    hidden_size: int = 64
    moe_intermediate_size: int = 64  # a multiple of 16 and 32: every expert weight takes the AITER shuffle
    num_experts: int = 4
    num_experts_per_tok: int = 2
    num_hidden_layers: int = 2  # divides by pp=2
    num_attention_heads: int = 4  # heads and KV heads divide by trainer TP=2
    num_key_value_heads: int = 2
    head_dim: int = 16


@dataclass(frozen=True, kw_only=True)
class MoeCheckpointRecipe:
    """Everything that determines the Qwen3-MoE checkpoint's bytes: a target with one MTP layer, no draft."""

    seed: int = 0
    language: LanguageRecipe = field(default_factory=LanguageRecipe)
    target: MoeShape = field(default_factory=MoeShape)
    dtype: str = "float32"
    target_steps: int = 60
    batch_size: int = 32
    seq_len: int = 64
    lr: float = 3e-3
    mtp_weight: float = 0.3
    log_every: int = 20

    def __post_init__(self) -> None:
        problems = [
            f"{name}={getattr(self, name)} must be positive"
            for name in ("target_steps", "batch_size", "seq_len", "log_every")
            if getattr(self, name) <= 0
        ]
        if self.seq_len < 3:
            problems.append(f"seq_len={self.seq_len} must be at least 3 (the MTP head predicts two tokens ahead)")
        if problems:
            raise ValueError("; ".join(problems))


# arch (HF model_type) -> its default recipe; `cached_checkpoints` builds these.
_RECIPES: dict[str, type] = {"qwen3": CheckpointRecipe, "qwen3_moe": MoeCheckpointRecipe}
BUILT_IN_ARCHS: tuple[str, ...] = tuple(_RECIPES)


def recipe_digest(recipe: CheckpointRecipe | MoeCheckpointRecipe) -> str:
    """Short hash naming a cached build: the recipe, the format version and the library versions."""
    import transformers

    payload = {
        "recipe": dataclasses.asdict(recipe),
        "format": _FORMAT_VERSION,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def next_token(x: torch.Tensor | int, language: LanguageRecipe) -> torch.Tensor | int:
    """The language's deterministic successor of a token (what an intact model predicts greedily)."""
    return (language.multiplier * x + language.increment) % language.vocab_size


def sample_sequences(
    generator: torch.Generator, *, batch_size: int, length: int, language: LanguageRecipe
) -> torch.Tensor:
    """[batch_size, length] int64 sequences of the language, drawn from `generator` only."""
    vocab = language.vocab_size
    tokens = torch.empty(batch_size, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch_size,), generator=generator)
    is_noise = torch.rand(batch_size, length, generator=generator) < language.noise
    noise = torch.randint(vocab, (batch_size, length), generator=generator)
    for t in range(1, length):
        tokens[:, t] = torch.where(is_noise[:, t], noise[:, t], next_token(tokens[:, t - 1], language))
    return tokens


def _qwen3_config(shape: ModelShape, *, recipe: CheckpointRecipe, num_mtp_layers: int):
    config_class = model_family("qwen3").config_class
    return config_class(
        vocab_size=recipe.language.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,  # Qwen3Config defaults it to 128, far wider than these models
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        num_nextn_predict_layers=num_mtp_layers,
        architectures=["Qwen3ForCausalLM"],
        dtype=recipe.dtype,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _qwen3_moe_config(shape: MoeShape, *, recipe: MoeCheckpointRecipe):
    config_class = model_family("qwen3_moe").config_class
    return config_class(
        vocab_size=recipe.language.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=2 * shape.moe_intermediate_size,  # dense MLP width; every layer here is sparse
        moe_intermediate_size=shape.moe_intermediate_size,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        num_nextn_predict_layers=1,
        architectures=["Qwen3MoeForCausalLM"],
        dtype=recipe.dtype,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _train_target(
    recipe: CheckpointRecipe | MoeCheckpointRecipe, generator: torch.Generator, *, config
) -> tuple[CausalLM, MTPHead, dict]:
    lm = CausalLM(config, seed=recipe.seed)
    mtp = MTPHead(config, seed=recipe.seed + 1)
    params = list(lm.parameters()) + list(mtp.parameters())
    optimizer = torch.optim.Adam(params, lr=recipe.lr)
    embed, lm_head = lm.hf.model.embed_tokens, lm.hf.lm_head
    vocab = recipe.language.vocab_size
    for step in range(1, recipe.target_steps + 1):
        tokens = sample_sequences(
            generator, batch_size=recipe.batch_size, length=recipe.seq_len + 1, language=recipe.language
        )
        inputs = tokens[:, :-1]
        out = lm(inputs)
        lm_loss = F.cross_entropy(out.logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        # Head position i reads (x_{i+1}, h_i) and predicts x_{i+2}.
        mtp_out = mtp(tokens[:, 1:-1], out.hidden[:, :-1], embed_tokens=embed, lm_head=lm_head)
        mtp_loss = F.cross_entropy(mtp_out.logits.reshape(-1, vocab), tokens[:, 2:].reshape(-1))
        loss = lm_loss + recipe.mtp_weight * mtp_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % recipe.log_every == 0 or step == recipe.target_steps:
            _log(
                f"target step {step}/{recipe.target_steps}: lm loss {lm_loss.item():.4f} mtp loss {mtp_loss.item():.4f}"
            )
    metrics = {"target_lm_loss": round(lm_loss.item(), 6), "target_mtp_loss": round(mtp_loss.item(), 6)}
    return lm, mtp, metrics


def _train_draft(recipe: CheckpointRecipe, generator: torch.Generator) -> tuple[CausalLM, dict]:
    config = _qwen3_config(recipe.draft, recipe=recipe, num_mtp_layers=0)
    lm = CausalLM(config, seed=recipe.seed + 2)
    optimizer = torch.optim.Adam(lm.parameters(), lr=recipe.lr)
    vocab = recipe.language.vocab_size
    for step in range(1, recipe.draft_steps + 1):
        tokens = sample_sequences(
            generator, batch_size=recipe.batch_size, length=recipe.seq_len + 1, language=recipe.language
        )
        logits = lm(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % recipe.log_every == 0 or step == recipe.draft_steps:
            _log(f"draft step {step}/{recipe.draft_steps}: lm loss {loss.item():.4f}")
    return lm, {"draft_lm_loss": round(loss.item(), 6)}


def _write_checkpoint(out: Path, *, config, tensors: dict[str, torch.Tensor], record: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    # The diff against the class defaults, as save_pretrained writes it; private runtime keys are not config.
    config_dict = {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")}
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    # Own contiguous copies: safetensors refuses tensors that share storage.
    save_file(
        {name: t.detach().contiguous().clone() for name, t in sorted(tensors.items())},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "recipe.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    if config.vocab_size == 256:
        _write_byte_tokenizer(out)


def _write_byte_tokenizer(out: Path) -> None:
    """An HF fast tokenizer whose token ids are the UTF-8 bytes of the text (byte-level BPE without merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(str(out))


def build_moe_checkpoint(out: str | os.PathLike, recipe: MoeCheckpointRecipe | None = None) -> Path:
    """Train and write `out/target`, the Qwen3-MoE target with its MTP layer; returns `out`. Deterministic as
    `build_checkpoints`."""
    recipe = MoeCheckpointRecipe() if recipe is None else recipe
    out = Path(out)
    started = time.monotonic()
    generator = torch.Generator().manual_seed(recipe.seed)
    lm, mtp, metrics = _train_target(recipe, generator, config=_qwen3_moe_config(recipe.target, recipe=recipe))
    record = {"recipe": dataclasses.asdict(recipe), "digest": recipe_digest(recipe), "metrics": metrics}
    tensors = {**lm.hf_parameters(), **mtp.hf_parameters()}
    _write_checkpoint(out / "target", config=lm.config, tensors=tensors, record={**record, "role": "target"})
    _log(f"wrote {out}/target in {time.monotonic() - started:.1f} s")
    return out


def build_checkpoints(out: str | os.PathLike, recipe: CheckpointRecipe | None = None) -> Path:
    """Train and write `out/target` (with its MTP layer) and `out/draft`; returns `out`.

    Deterministic for a fixed recipe and thread count. Progress goes to stderr. The caller chooses the threads.
    """
    recipe = CheckpointRecipe() if recipe is None else recipe
    out = Path(out)
    started = time.monotonic()
    generator = torch.Generator().manual_seed(recipe.seed)
    config = _qwen3_config(recipe.target, recipe=recipe, num_mtp_layers=1)
    lm, mtp, target_metrics = _train_target(recipe, generator, config=config)
    draft, draft_metrics = _train_draft(recipe, generator)
    record = {
        "recipe": dataclasses.asdict(recipe),
        "digest": recipe_digest(recipe),
        "metrics": {**target_metrics, **draft_metrics},
    }
    target_tensors = {**lm.hf_parameters(), **mtp.hf_parameters()}
    _write_checkpoint(out / "target", config=lm.config, tensors=target_tensors, record={**record, "role": "target"})
    _write_checkpoint(
        out / "draft", config=draft.config, tensors=draft.hf_parameters(), record={**record, "role": "draft"}
    )
    _log(f"wrote {out}/target and {out}/draft in {time.monotonic() - started:.1f} s")
    return out


def cached_checkpoints(
    cache_dir: str | os.PathLike,
    *,
    arch: str = "qwen3",
    recipe: CheckpointRecipe | MoeCheckpointRecipe | None = None,
    threads: int = 1,
    timeout_s: float = 900.0,
) -> Path:
    """The checkpoints of `recipe` under `cache_dir/reference-<digest>` (`reference-<arch>-<digest>` for any arch
    but qwen3), built once by a subprocess: `target/` and, for qwen3, `draft/`.

    `arch` picks the built-in recipe when `recipe` is None ("qwen3" or "qwen3_moe"; ValueError listing them for any
    other); a given recipe must be of that arch's recipe type.

    One thread by default: on a shared 2-core machine a second intra-op thread made the build several times
    slower, and the bytes were identical at 1 and 2 threads.

    Concurrent callers (several test sessions) wait on a file lock instead of training twice; a build is moved
    into place only when complete, so a killed build never leaves a half-written directory behind.
    """
    recipe_class = _RECIPES.get(arch)
    if recipe_class is None:
        raise ValueError(f"no built-in reference checkpoint for arch {arch!r}; built-in: {', '.join(BUILT_IN_ARCHS)}")
    recipe = recipe_class() if recipe is None else recipe
    if not isinstance(recipe, recipe_class):
        raise ValueError(f"arch {arch!r} takes a {recipe_class.__name__}, got a {type(recipe).__name__}")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # The dense name (and its completion marker, the draft written last) predate the other archs: kept as they were.
    final = cache_dir / (
        f"reference-{recipe_digest(recipe)}" if arch == "qwen3" else f"reference-{arch}-{recipe_digest(recipe)}"
    )
    marker = final / ("draft" if arch == "qwen3" else "target") / "recipe.json"
    if marker.is_file():
        return final
    with open(cache_dir / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if marker.is_file():
                return final
            staging = Path(tempfile.mkdtemp(prefix=f"{final.name}.", dir=cache_dir))
            try:
                recipe_file = staging / "recipe-in.json"
                recipe_file.write_text(json.dumps(dataclasses.asdict(recipe)))
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "miles_sync.engine.reference.checkpoints",
                        "--out",
                        str(staging / "out"),
                        "--recipe",
                        str(recipe_file),
                        "--threads",
                        str(threads),
                        "--arch",
                        arch,
                    ],
                    check=True,
                    timeout=timeout_s,
                )
                os.replace(staging / "out", final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def _recipe_from_dict(data: dict, *, arch: str = "qwen3") -> CheckpointRecipe | MoeCheckpointRecipe:
    if arch == "qwen3_moe":
        return MoeCheckpointRecipe(
            **{**data, "language": LanguageRecipe(**data["language"]), "target": MoeShape(**data["target"])}
        )
    return CheckpointRecipe(
        **{
            **data,
            "language": LanguageRecipe(**data["language"]),
            "target": ModelShape(**data["target"]),
            "draft": ModelShape(**data["draft"]),
        }
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory (target/ and draft/ are created in it)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the default recipe (default 0)")
    parser.add_argument("--recipe", default=None, help="JSON file with a full recipe (overrides --seed)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads; part of the determinism")
    parser.add_argument("--arch", choices=BUILT_IN_ARCHS, default="qwen3", help="which built-in model to build")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads={args.threads} must be at least 1")
    torch.set_num_threads(args.threads)
    if args.recipe is not None:
        recipe = _recipe_from_dict(json.loads(Path(args.recipe).read_text()), arch=args.arch)
    else:
        recipe = _RECIPES[args.arch](seed=0 if args.seed is None else args.seed)
    if args.arch == "qwen3_moe":
        build_moe_checkpoint(args.out, recipe)
    else:
        build_checkpoints(args.out, recipe)


if __name__ == "__main__":
    main()
