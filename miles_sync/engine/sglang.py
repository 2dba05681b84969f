"""The `sglang` engine kind: an SGLang 0.5.23 server (`sglang.launch_server`) on a GPU node, or on a CPU machine.

The command line is built from the launch settings, flag by flag (the README's table maps each config key to its
flag; tests/unit/test_sglang_command.py parses every command with the flags SGLang's parser defines). SGLang needs
a port up front, so the spec asks the OS for a free one on the bind host right before the start. The keys travel
in the environment and `miles_sync.engine.sglang_launch` hands them to SGLang inside its process, never on the
command line.

What the sync needs from the server and why no flag asks for it: the weight-update routes
(`/init_weights_update_group`, `/update_weights_from_distributed`, `/update_weights_from_tensor`, the session and
`/weights_checker` routes) are always on in 0.5.23; they refuse data parallelism (dp_size must stay 1, the
default); the update group takes no timeout flag. `--load-format dummy` is never used: a frozen draft is left out of
every sync, so its weights must come from the checkpoint. `--enable-memory-saver` serves
release/resume_memory_occupation, which miles_sync does not call.

On a CPU (`device="cpu"`) the released wheel runs as set up by launch/install_sglang.sh, in its own venv
(`python`): SGLang's CPU switch (SGLANG_USE_CPU_ENGINE=1; `--device cpu` alone still imports GPU kernels), the
project's import shims for what PyPI has no CPU build of (MILES_SYNC_SGLANG_CPU_SHIM=1), one OpenMP thread per TP
rank pinned to its own core (SGLang asserts TP ranks <= NUMA nodes otherwise), and the flags in `CPU_FLAGS`
(measured on a 2-core machine: torch-native attention and sampling, no grammar backend, no CUDA graphs, a small
KV pool). The server's interpreter must import `miles_sync.engine.sglang_launch` (stdlib only: the install script
puts miles_sync into that venv without its dependencies).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from miles_sync.engine.command import LaunchCommand, reserve_port, url_host
from miles_sync.engine.settings import EngineSettings, LoraSettings
from miles_sync.env import (
    CPU_SHIM_VARIABLE,
    ENGINE_ADMIN_API_KEY_VARIABLE,
    ENGINE_API_KEY_VARIABLE,
    LOOPBACK_HOST,
)
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.text import raise_if

__all__ = ["sglang_speculative_problems"]

# SGLang's algorithm names and the drafts each runs: NEXTN is EAGLE over the MTP layers of the target checkpoint;
# EAGLE takes those (DeepSeek-style MTP) or a separate EAGLE head; EAGLE3 and STANDALONE a separate draft model;
# NGRAM drafts from the request's own history (no draft model).
SGLANG_DRAFT_KINDS: dict[str, frozenset[DraftKind]] = {
    "NEXTN": frozenset({DraftKind.MTP}),
    "EAGLE": frozenset({DraftKind.MTP, DraftKind.STANDALONE}),
    "EAGLE3": frozenset({DraftKind.STANDALONE}),
    "STANDALONE": frozenset({DraftKind.STANDALONE}),
    "NGRAM": frozenset({DraftKind.NGRAM}),
}
SGLANG_LAUNCH_MODULE = "miles_sync.engine.sglang_launch"  # the entry point that hands SGLang its keys
# SGLang 0.5.23 on a CPU without sgl-kernel's CPU build (launch/install_sglang.sh): every flag here was needed to
# start a dense Qwen3 server on this kind of machine, or keeps its idle cost down (no warm-up request; and
# `--sleep-on-idle`: an idle scheduler otherwise polls its sockets without blocking, measured at 55-70% of a core per
# idle TP=1 server on this 2-core machine, which starved trainer ranks sharing the cores: their set-up took 68 s, and
# past 300 s on a slower host. Asleep it waits on the same sockets, so a request wakes it at once).
CPU_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--cuda-graph-backend-decode",
    "disabled",
    "--cuda-graph-backend-prefill",
    "disabled",
    "--skip-server-warmup",
    "--dtype",
    "float32",
    "--mem-fraction-static",
    "0.1",
    "--max-total-tokens",
    "4096",
    "--sleep-on-idle",
)
# Flags extra_args may not give besides those built here: the keys (they travel in the environment) and SGLang's
# other spellings of built flags.
_RESERVED_FLAGS = frozenset(
    {"--api-key", "--admin-api-key", "--model", "--tensor-parallel-size", "--speculative-draft-model"}
)
# SGLang 0.5.23 runs LoRA adapters with these algorithms only (`check_lora_speculative_compatibility`).
_LORA_ALGORITHMS = frozenset({"NEXTN", "EAGLE", "EAGLE3", "NGRAM"})


def sglang_speculative_problems(
    *, speculative_algorithm: str | None, draft_kind: DraftKind | str, has_lora: bool = False
) -> list[str]:
    """What SGLang 0.5.23 would refuse (or run differently from what miles_sync assumes) about a speculative setup;
    empty when it is fine. Pure; shared by the spec and the config check."""
    kind = DraftKind(draft_kind)
    if speculative_algorithm is None:
        if kind is DraftKind.NONE:
            return []
        return [f"draft_kind={kind.value!r} needs a speculative_algorithm (SGLang's {', '.join(SGLANG_DRAFT_KINDS)})"]
    algorithm = speculative_algorithm.upper()  # SGLang upper-cases the name before it resolves it
    kinds = SGLANG_DRAFT_KINDS.get(algorithm)
    if kinds is None:
        return [
            f"speculative_algorithm={speculative_algorithm!r} has no SGLang launch mapping here; use one of "
            f"{', '.join(SGLANG_DRAFT_KINDS)} (NEXTN for MTP layers in the target checkpoint)"
        ]
    problems = []
    if kind not in kinds:
        allowed = " or ".join(sorted(repr(k.value) for k in kinds))
        problems.append(f"speculative_algorithm={algorithm!r} runs draft_kind {allowed}, not {kind.value!r}")
    if has_lora and algorithm not in _LORA_ALGORITHMS:
        problems.append(
            f"SGLang serves LoRA adapters with speculative_algorithm {', '.join(sorted(_LORA_ALGORITHMS))} "
            f"or none, not {algorithm!r}"
        )
    return problems


@dataclass(frozen=True, kw_only=True)
class SGLangEngineSpec:
    """An SGLang server (GPU nodes). `extra_args` go to `sglang.launch_server` as they are, after the flags built
    here (none of which they may repeat)."""

    model_path: str
    tp_size: int = 1
    speculative_algorithm: str | None = None  # SGLang's name; None: no speculative decoding
    draft_kind: DraftKind = DraftKind.NONE
    draft_model_path: str | None = None  # a separate draft checkpoint (draft_kind standalone only)
    spec_steps: int = 3  # tokens the draft proposes per verify step
    lora: LoraSettings | None = None
    extra_args: tuple[str, ...] = ()
    device: str | None = None  # SGLang's --device; "cpu" adds CPU_FLAGS and the CPU environment; None: its default
    python: str | None = None  # the server's interpreter (its own venv); None: this one
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or a report
    admin_api_key: str | None = field(default=None, repr=False)  # SGLang's --admin-api-key; a secret as well
    custom_weight_loaders: tuple[str, ...] = ()  # SGLang's --custom-weight-loader: load_formats updates may name

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> SGLangEngineSpec:
        return cls(
            model_path=settings.model_dir,
            tp_size=settings.tp_size,
            speculative_algorithm=settings.speculative_algorithm,
            draft_kind=settings.draft_kind,
            draft_model_path=settings.draft_dir,
            spec_steps=settings.spec_steps,
            lora=settings.lora,
            device=settings.device,
            python=settings.server_python,
            api_key=settings.api_key,
            admin_api_key=settings.admin_api_key,
            custom_weight_loaders=settings.custom_weight_loaders,
        )

    def __post_init__(self) -> None:
        problems = []
        if self.tp_size < 1:
            problems.append(f"tp_size={self.tp_size} must be at least 1")
        if self.spec_steps < 1:
            problems.append(f"spec_steps={self.spec_steps} must be at least 1")
        problems += sglang_speculative_problems(
            speculative_algorithm=self.speculative_algorithm,
            draft_kind=self.draft_kind,
            has_lora=self.lora is not None,
        )
        is_standalone = DraftKind(self.draft_kind) is DraftKind.STANDALONE
        if is_standalone and self.draft_model_path is None:
            problems.append("draft_kind='standalone' needs draft_model_path (the draft's checkpoint)")
        if not is_standalone and self.draft_model_path is not None:
            problems.append(f"draft_model_path={self.draft_model_path!r} applies to draft_kind 'standalone' only")
        for what, key in (("api_key", self.api_key), ("admin_api_key", self.admin_api_key)):
            if key is not None and not key:
                problems.append(f"{what} must be None or a non-empty string")
        if self.admin_api_key is not None and self.api_key is None:
            # SGLang opens its normal routes to everyone when only the admin key is set, and /server_info (one of
            # them) answers every server argument, the admin key included.
            problems.append("admin_api_key needs api_key as well: without it SGLang's /server_info shows it to anyone")
        raise_if(problems, what="invalid SGLangEngineSpec")
        built = {arg for arg in self._flags(host=LOOPBACK_HOST, port=0, with_extra=False) if arg.startswith("--")}
        repeated = sorted({arg.partition("=")[0] for arg in self.extra_args} & (built | _RESERVED_FLAGS))
        if repeated:
            raise ValueError(f"invalid SGLangEngineSpec: extra_args repeat flags built here: {', '.join(repeated)}")

    def command(self, *, host: str) -> LaunchCommand:
        """Bind `host` (the node's address, or loopback) on a port free there now; the URL is known in advance."""
        port = reserve_port(host)
        python = sys.executable if self.python is None else self.python
        argv = [python, "-m", SGLANG_LAUNCH_MODULE, *self._flags(host=host, port=port)]
        keys = ((ENGINE_API_KEY_VARIABLE, self.api_key), (ENGINE_ADMIN_API_KEY_VARIABLE, self.admin_api_key))
        env = {variable: key for variable, key in keys if key is not None}
        if self.device == "cpu":
            env.update(cpu_environment(self.tp_size))
        return LaunchCommand(argv=tuple(argv), url=f"http://{url_host(host)}:{port}", env=env)

    def _flags(self, *, host: str, port: int, with_extra: bool = True) -> list[str]:
        """SGLang's arguments but the keys, in the README table's order."""
        flags = ["--host", host, "--port", str(port), "--model-path", self.model_path, "--tp-size", str(self.tp_size)]
        if self.device == "cpu":
            flags += CPU_FLAGS
        elif self.device is not None:
            flags += ["--device", self.device]
        flags += self._speculative_flags()
        if self.lora is not None:
            flags += _lora_flags(self.lora)
        if self.custom_weight_loaders:
            flags += ["--custom-weight-loader", *self.custom_weight_loaders]
        return [*flags, *(self.extra_args if with_extra else ())]

    def _speculative_flags(self) -> list[str]:
        if self.speculative_algorithm is None:
            return []
        algorithm = self.speculative_algorithm.upper()
        flags = ["--speculative-algorithm", algorithm]
        # SGLang verifies the last accepted token plus the drafted ones: k drafted tokens make a window of k + 1.
        num_draft_tokens = str(self.spec_steps + 1)
        if algorithm == "NGRAM":  # drafts from a token trie; SGLang derives its steps and breadth itself
            return [*flags, "--speculative-num-draft-tokens", num_draft_tokens]
        # MTP layers live in the target checkpoint. SGLang fills that path in by itself only for the architectures
        # it lists (DeepSeek-V3 and kin) and needs it for every other one, so it is always given (same value).
        is_mtp = DraftKind(self.draft_kind) is DraftKind.MTP
        draft = self.model_path if is_mtp else self.draft_model_path
        assert draft is not None  # __post_init__: standalone drafts name their checkpoint
        # A chain (top-k 1), as the reference engine drafts: SGLang then needs num_draft_tokens == steps + 1.
        return [
            *flags,
            "--speculative-draft-model-path",
            draft,
            "--speculative-num-steps",
            str(self.spec_steps),
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            num_draft_tokens,
        ]


def cpu_environment(tp_size: int, *, num_cores: int | None = None) -> dict[str, str]:
    """The environment of a CPU server with `tp_size` ranks: SGLang's CPU switch, the project's import shims, and
    one core per rank (SGLANG_CPU_OMP_THREADS_BIND, ranks wrapping around the cores when there are more ranks)."""
    cores = (os.cpu_count() or 1) if num_cores is None else num_cores
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        CPU_SHIM_VARIABLE: "1",
        "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(rank % cores) for rank in range(tp_size)),
        "OMP_NUM_THREADS": "1",
    }


def _lora_flags(lora: LoraSettings) -> list[str]:
    """Room for adapters loaded later from tensors: SGLang needs the rank and target modules up front when no
    adapter is given at start (`--lora-paths`)."""
    flags = ["--enable-lora", "--max-lora-rank", str(lora.max_rank), "--lora-target-modules", *lora.target_modules]
    if lora.max_loras_per_batch is not None:
        flags += ["--max-loras-per-batch", str(lora.max_loras_per_batch)]
    if lora.max_loaded_loras is not None:
        flags += ["--max-loaded-loras", str(lora.max_loaded_loras)]
    return flags
