"""The `reference` engine kind's launch spec: `python -m miles_sync.engine.reference.serve ... --port 0`.

The OS picks the port and the server prints "listening on URL" once it accepts connections; the launcher reads it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from miles_sync.engine.command import LaunchCommand
from miles_sync.engine.settings import EngineSettings, FinalizePolicy, LoraSettings
from miles_sync.env import ENGINE_ADMIN_API_KEY_VARIABLE, ENGINE_API_KEY_VARIABLE
from miles_sync.weights.checksum import TensorHash
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.protocol import ChecksumNames
from miles_sync.wire.text import raise_if

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine


@dataclass(frozen=True, kw_only=True)
class ReferenceEngineSpec:
    """The built-in CPU reference engine (`miles_sync.engine.reference.serve`)."""

    model_dir: str
    draft_kind: DraftKind = DraftKind.NONE
    draft_dir: str | None = None  # standalone drafts only
    weight_layout: WeightLayout = WeightLayout.NONE
    finalize_policy: FinalizePolicy = FinalizePolicy.STRICT
    spec_steps: int = 3
    tp_size: int = 1  # tensor-parallel ranks; 1 keeps the command line of an engine without TP
    is_draft_frozen: bool = False
    num_threads: int | None = 1  # torch intra-op threads of the server; None: torch's default
    collective_timeout_s: float | None = None  # None: the server's default (MILES_SYNC_COLLECTIVE_TIMEOUT_S)
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or a report
    admin_api_key: str | None = field(default=None, repr=False)  # the admin routes' key; a secret as well
    lora: LoraSettings | None = None  # serve LoRA adapters (SGLang's --enable-lora and its room flags)
    # What /weights_checker checksum answers: ENGINE is what SGLang's checker answers (engine parameters, per TP
    # rank); None is the server's default (HF names at TP=1, engine parameters at TP>1).
    checksum_names: ChecksumNames | None = None
    # How engine-named digests are computed: SGLang's CPU SHA-256, or GPU_HASH to answer as a CUDA server does.
    tensor_hash: TensorHash = TensorHash.SHA256
    custom_weight_loaders: tuple[str, ...] = ()  # `--custom-weight-loader`: load_formats a tensor update may name

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> ReferenceEngineSpec:
        return cls(
            model_dir=settings.model_dir,
            draft_kind=settings.draft_kind,
            draft_dir=settings.draft_dir,
            weight_layout=settings.weight_layout,
            finalize_policy=settings.finalize_policy,
            spec_steps=settings.spec_steps,
            tp_size=settings.tp_size,
            collective_timeout_s=settings.collective_timeout_s,
            api_key=settings.api_key,
            admin_api_key=settings.admin_api_key,
            lora=settings.lora,
            custom_weight_loaders=settings.custom_weight_loaders,
        )

    def __post_init__(self) -> None:
        problems = []
        for what, key in (("api_key", self.api_key), ("admin_api_key", self.admin_api_key)):
            if key is not None and not key:
                problems.append(f"{what} must be None or a non-empty string")
        if self.spec_steps < 1:
            problems.append(f"spec_steps={self.spec_steps} must be at least 1")
        if self.tp_size < 1:
            problems.append(f"tp_size={self.tp_size} must be at least 1")
        if self.num_threads is not None and self.num_threads < 1:
            problems.append(f"num_threads={self.num_threads} must be at least 1 (or None)")
        if self.collective_timeout_s is not None and not self.collective_timeout_s > 0:
            problems.append(f"collective_timeout_s={self.collective_timeout_s} must be positive (or None)")
        if self.checksum_names is not None and self.tp_size > 1 and self.checksum_names is not ChecksumNames.ENGINE:
            problems.append(f"checksum_names={self.checksum_names.value!r} needs tp_size 1: TP ranks hold shards")
        if TensorHash(self.tensor_hash) is not TensorHash.SHA256 and self.checksum_names is not ChecksumNames.ENGINE:
            problems.append(f"tensor_hash={TensorHash(self.tensor_hash).value!r} needs checksum_names=ENGINE")
        if (self.draft_dir is not None) != (DraftKind(self.draft_kind) is DraftKind.STANDALONE):
            problems.append(f"draft_dir={self.draft_dir!r} must be given exactly for draft_kind 'standalone'")
        raise_if(problems, what="invalid ReferenceEngineSpec")

    def command(self, *, host: str) -> LaunchCommand:
        argv = [
            sys.executable,
            "-m",
            "miles_sync.engine.reference.serve",
            "--model",
            self.model_dir,
            "--draft-kind",
            DraftKind(self.draft_kind).value,
            "--weight-layout",
            WeightLayout(self.weight_layout).value,
            "--finalize-policy",
            FinalizePolicy(self.finalize_policy).value,
            "--spec-steps",
            str(self.spec_steps),
            "--host",
            host,
            "--port",
            "0",
        ]
        if self.draft_dir is not None:
            argv += ["--draft", self.draft_dir]
        if self.is_draft_frozen:
            argv.append("--draft-is-frozen")
        if self.tp_size > 1:
            argv += ["--tp-size", str(self.tp_size)]
        if self.num_threads is not None:
            argv += ["--threads", str(self.num_threads)]
        if self.collective_timeout_s is not None:
            argv += ["--collective-timeout-s", str(self.collective_timeout_s)]
        if self.checksum_names is not None:
            argv += ["--checksum-names", ChecksumNames(self.checksum_names).value]
        if TensorHash(self.tensor_hash) is not TensorHash.SHA256:
            argv += ["--tensor-hash", TensorHash(self.tensor_hash).value]
        if self.lora is not None:
            argv += ["--enable-lora", "--max-lora-rank", str(self.lora.max_rank)]
            argv += ["--lora-target-modules", *self.lora.target_modules]
        if self.custom_weight_loaders:
            argv += ["--custom-weight-loader", *self.custom_weight_loaders]
        # Keys travel in the environment, never on the command line (readable by every local user).
        keys = ((ENGINE_API_KEY_VARIABLE, self.api_key), (ENGINE_ADMIN_API_KEY_VARIABLE, self.admin_api_key))
        secrets = {variable: key for variable, key in keys if key is not None}
        return LaunchCommand(argv=tuple(argv), url=None, env=secrets)
