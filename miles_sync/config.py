"""Typed configuration: frozen keyword-only records, mirrored 1:1 by conf/default.yaml.

OmegaConf cannot merge into frozen dataclasses (it marks their nodes read-only) and takes enum members by name,
not by value. So loading goes through a structured *schema*: a mutable mirror of these records, derived from
them (enums as their string values, tuples as lists). OmegaConf merges the YAML and the dotlist overrides into the
schema, which rejects unknown keys and ill-typed scalars with the key's path; the plain container it produces is
then decoded into the frozen records by miles_sync.wire.codec, which checks enum values and runs each record's
validation. Every failure is a ValueError naming the dotted path of the key.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from miles_sync.engine.kinds import EngineKind
from miles_sync.engine.router import ROUTER_POLICIES
from miles_sync.engine.settings import EngineSettings, FinalizePolicy, LoraSettings
from miles_sync.engine.sglang import sglang_speculative_problems
from miles_sync.env import bind_host
from miles_sync.export.registry import ConversionMode
from miles_sync.megatron.parallel_layout import parallel_layout_problems
from miles_sync.sync.draft_canary import CanaryMode
from miles_sync.sync.selector import SelectorMode, selector_input_problems
from miles_sync.transport.base import TransportKind, transport_spec
from miles_sync.weights.fp8 import DEFAULT_BLOCK, Fp8Block, Quantization
from miles_sync.weights.layout import WeightLayout
from miles_sync.wire.codec import WireEnum, decode, encode
from miles_sync.wire.draft import DraftKind
from miles_sync.wire.protocol import PauseMode
from miles_sync.wire.text import raise_if

__all__ = [
    "DEFAULT_CONFIG_DIR",
    "ClusterConfig",
    "EngineConfig",
    "LoraSyncConfig",
    "MilesSyncConfig",
    "ModelConfig",
    "RolloutConfig",
    "SyncConfig",
    "SyncMode",
    "TrainerConfig",
    "load_config",
    "to_config",
    "to_yaml",
]

DEFAULT_CONFIG_DIR = Path(__file__).resolve().parent.parent / "conf"

_MIB = 1024 * 1024


class SyncMode(WireEnum):
    """full: every weight goes to the engines; lora: the trainer trains LoRA adapters on a frozen base and a sync
    sends only the adapter (SGLang's /load_lora_adapter_from_tensors), never the base."""

    FULL = "full"
    LORA = "lora"


@dataclass(frozen=True, kw_only=True)
class LoraSyncConfig:
    """The adapter a `sync.mode=lora` run trains and syncs: PEFT's r, lora_alpha and target_modules (transformers'
    module names; megatron fuses q/k/v and gate/up, so those come together), the engines' adapter name (what
    rollouts pass as `lora_path`), and the size from which the adapter travels as one flattened bucket per TP rank
    instead of a dict of tensors."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    name: str = "policy"
    flatten_min_bytes: int = _MIB

    def __post_init__(self) -> None:
        problems = []
        if self.rank < 1:
            problems.append(f"rank={self.rank} must be at least 1")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            problems.append(f"alpha={self.alpha} must be a positive number")
        if not self.target_modules or len(set(self.target_modules)) != len(self.target_modules):
            problems.append(f"target_modules={list(self.target_modules)} must name distinct modules, at least one")
        if not self.name:
            problems.append("name must not be empty")
        if self.flatten_min_bytes < 0:
            problems.append(f"flatten_min_bytes={self.flatten_min_bytes} must be >= 0")
        raise_if(problems)

    def engine_settings(self) -> LoraSettings:
        """The adapter room an engine reserves at start for this adapter (--max-lora-rank, --lora-target-modules)."""
        return LoraSettings(max_rank=self.rank, target_modules=self.target_modules)


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    transport: TransportKind = TransportKind.DISTRIBUTED
    conversion: ConversionMode = ConversionMode.RAW
    bucket_bytes: int = 256 * _MIB
    selector: SelectorMode = SelectorMode.AUTO
    pause_mode: PauseMode = PauseMode.ABORT
    verify: bool = True  # compare trainer-side checksums with each engine's after every sync
    http_timeout_s: float = 60.0
    collective_timeout_s: float = 120.0
    sync_timeout_s: float = 600.0  # one whole sync, pause to resume
    # pause_mode=in_place: the sync asks each engine once, after the resume, to flush its prefix cache, and retries
    # a refusal (SGLang refuses while a request runs) for this long. Under steady load none ends in time and every
    # retry window is time the training loop waits (0.5 s doubled an in_place sync here), so 0: one attempt. The
    # report says per engine what happened to its cache.
    in_place_flush_s: float = 0.0
    # Refuse a selector whose draft runner the export cannot feed (a frozen draft under `all`). Off only to
    # reproduce what systems without the check do (demo=frozen_draft_bug).
    check_selector: bool = True
    # Export, pack and hash the whole next version before the pause, while the engines still generate (with the
    # expected engine-layout digests for engines that answer SGLang's checker digests); the pause then covers
    # transfer, finalize and the engines' own verification. Costs one packed copy of the model in the source rank's
    # memory.
    staged: bool = False
    # Prove the update mechanism on the first sync of a fresh fleet (version 0 -> 1): snapshot the engines' weights,
    # reset them to random values, sync, compare. Only when the trainer then holds exactly the weights the engines
    # loaded at start; otherwise the compare fails and every engine stays paused.
    mechanism_check: bool = False
    # False: the job trains exactly as usual but never syncs, so the engines keep serving the checkpoint (the
    # control run: whatever the rollouts' reward does then did not come through the sync).
    enabled: bool = True
    # A file every committed version is written to and read from at connect: for a long-lived fleet (engines.urls)
    # whose controller restarts, so that versions continue even when every engine restarted too (then none reports
    # one). None: the engines' answers alone (a launched fleet is new with every job).
    version_file: str | None = None
    # fp8_block: the source quantizes every linear weight to float8_e4m3fn with one float32 weight_scale_inv per
    # fp8_block ([rows, cols]) after the gather, and launched engines serve the block-FP8 copy of the checkpoint.
    # fp8_block None: 128x128, or the largest smaller square power-of-two block that divides every TP partition
    # of the checkpoint's model (the job decides it from config.json; the built-in tiny models get 32x32).
    quantization: Quantization = Quantization.NONE
    fp8_block: tuple[int, ...] | None = None
    # lora: train adapters on a frozen base and sync only them (see LoraSyncConfig).
    mode: SyncMode = SyncMode.FULL
    lora: LoraSyncConfig = field(default_factory=LoraSyncConfig)
    # The acceptance canary after every committed sync (miles_sync.sync.draft_canary): one greedy prompt per engine,
    # its draft accept length against the engine's last passing reading. none | warn (a report warning) | hold (the
    # engine is also held paused and the job stops). Opt-in: it costs one short generation per engine and sync.
    draft_canary: CanaryMode = CanaryMode.NONE
    draft_canary_min_ratio: float = 0.5

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.draft_canary_min_ratio <= 1:
            problems.append(f"draft_canary_min_ratio={self.draft_canary_min_ratio} is not in (0, 1]")
        if self.mode is SyncMode.LORA and self.draft_canary is not CanaryMode.NONE:
            problems.append("mode=lora has no draft canary (the engines' draft serves the base); set draft_canary=none")
        if self.mode is SyncMode.LORA:
            if self.quantization is not Quantization.NONE:
                problems.append("mode=lora sends adapters in the trainer's dtype; quantization must be none")
            # Both act on base weights, which a LoRA sync never sends.
            problems += [
                f"mode=lora has no {k}; set {k}=false" for k in ("staged", "mechanism_check") if getattr(self, k)
            ]
        if self.staged and self.conversion is ConversionMode.RAW and transport_spec(self.transport).routed_factory:
            # Each trainer rank converts and sends its own shards inside the pause (miles_sync.sync.routed).
            problems.append(
                f"transport={self.transport.value} with conversion=raw sends each trainer rank's own shards at send "
                "time and packs nothing ahead; set staged=false"
            )
        if self.bucket_bytes <= 0:
            problems.append(f"bucket_bytes={self.bucket_bytes} must be positive")
        if self.fp8_block is not None and (len(self.fp8_block) != 2 or not all(b > 0 for b in self.fp8_block)):
            problems.append(f"fp8_block={list(self.fp8_block)} must be two positive integers [rows, cols]")
        for name in ("http_timeout_s", "collective_timeout_s", "sync_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                problems.append(f"{name}={value} must be a positive number of seconds")
        if not (self.in_place_flush_s >= 0 and math.isfinite(self.in_place_flush_s)):
            problems.append(f"in_place_flush_s={self.in_place_flush_s} must be 0 or a positive number of seconds")
        raise_if(problems)

    @property
    def quantization_spec(self) -> Fp8Block | None:
        """The block-FP8 spec the source quantizes with; None when it sends the export's dtypes."""
        if self.quantization is Quantization.NONE:
            return None
        block = DEFAULT_BLOCK if self.fp8_block is None else self.fp8_block
        return Fp8Block(block=(int(block[0]), int(block[1])))

    def conversion_problems(self, *, arch: str, num_trained_mtp_layers: int, num_experts: int = 0) -> list[str]:
        """What `conversion` cannot export of a model (empty: nothing). Pure; the one check that config
        validation (`model.*`), the job driver (the checkpoint's config.json) and the trainer rank share.

        `arch`: the HF model_type; `num_trained_mtp_layers`: MTP layers the trainer builds and exports;
        `num_experts`: routed experts per MoE layer (0: dense). Raw mode exports every family miles_sync builds.
        """
        if self.conversion is not ConversionMode.BRIDGE:
            return []
        # Bridge mode is trusted for what its parity tests prove bit-exact (tests/multiproc/test_export_bridge.py):
        # dense llama, qwen2 and qwen3. MTP layers have no bridge mapping in miles_sync (export/bridge.py builds
        # none) and no MoE family has bridge parity on this megatron-bridge: refuse both before any actor starts.
        version = _megatron_bridge_version()
        refused = []
        if num_experts > 0 or arch.endswith("_moe"):
            experts = f" ({num_experts} experts per layer)" if num_experts > 0 else ""
            refused.append(f"the MoE experts of {arch}{experts}")
        elif arch not in _BRIDGE_ARCHS:
            refused.append(f"the {arch} family (bridge mode covers {', '.join(_BRIDGE_ARCHS)})")
        if num_trained_mtp_layers > 0:
            refused.append(f"the MTP layer of {arch} (model.num_trained_mtp_layers={num_trained_mtp_layers})")
        return [
            f"sync.conversion=bridge cannot export {what} on megatron-bridge {version}; use sync.conversion=raw"
            for what in refused
        ]

    def checkpoint_problems(self, hf_config: Mapping[str, Any], *, num_trained_mtp_layers: int) -> list[str]:
        """`conversion_problems` for the model a checkpoint's config.json describes (its dict: `json.load`, or a
        transformers config's `to_dict()`): family from `model_type`, experts from the usual HF keys. Pure."""
        experts = [hf_config.get(key) for key in _EXPERT_COUNT_KEYS]
        return self.conversion_problems(
            arch=str(hf_config.get("model_type", "unknown")),
            num_trained_mtp_layers=num_trained_mtp_layers,
            num_experts=max([n for n in experts if isinstance(n, int)], default=0),
        )


# Families bridge mode exports bit-exact (dense only); see SyncConfig.conversion_problems.
_BRIDGE_ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3")
# Routed experts per MoE layer, as HF configs name them (Qwen-MoE, Mixtral, DeepSeek).
_EXPERT_COUNT_KEYS: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts")


def _megatron_bridge_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        return "(not installed; launch/install_bridge.sh)"


_ENGINE_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    count: int = 2
    tp: int = 1  # tensor-parallel ranks of each launched engine (running servers given by `urls` report their own)
    kind: EngineKind = EngineKind.REFERENCE
    urls: tuple[str, ...] = ()  # already running servers to use instead of launching `count` engines
    weight_layout: WeightLayout = WeightLayout.AITER
    finalize_policy: FinalizePolicy = FinalizePolicy.STRICT
    draft_kind: DraftKind = DraftKind.MTP
    spec_steps: int = 3  # draft tokens proposed per verify step; used only with a draft
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or a report
    # SGLang's --admin-api-key: with one set, admin routes (weight updates, pause, checker) accept only it.
    admin_api_key: str | None = field(default=None, repr=False)
    # Launched SGLang servers only: SGLang's --device (auto: cpu where the launching process sees no CUDA device,
    # which adds the CPU flags of miles_sync.engine.sglang) and the Python that runs them (None: the venv of
    # launch/install_sglang.sh where it exists, else this interpreter).
    device: str = "auto"
    sglang_python: str | None = None
    # The elastic-fleet demo: launch one more engine before round N's sync and add it to the fleet
    # (SyncController.add_engine); it serves, and is routed, only after that sync verified on it. None: no joiner.
    join_at_round: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.join_at_round is not None and self.join_at_round < 1:
            problems.append(f"join_at_round={self.join_at_round} must be a round number (1 or more)")
        if self.join_at_round is not None and self.urls:
            problems.append("join_at_round launches the joiner: it needs launched engines, not engines.urls")
        if self.device not in _ENGINE_DEVICES:
            problems.append(f"device={self.device!r} must be one of {', '.join(_ENGINE_DEVICES)}")
        if self.count < 1:
            problems.append(f"count={self.count} must be at least 1")
        if self.tp < 1:
            problems.append(f"tp={self.tp} must be at least 1")
        if self.urls and len(self.urls) != self.count:
            problems.append(f"urls has {len(self.urls)} entries but count={self.count}; give one url per engine")
        bad_urls = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad_urls:
            problems.append(f"urls {bad_urls} must start with http:// or https://")
        if len(set(self.urls)) != len(self.urls):
            problems.append(f"urls {list(self.urls)} repeat a server")
        if self.spec_steps < 1:
            problems.append(f"spec_steps={self.spec_steps} must be at least 1")
        raise_if(problems)

    def launch_settings(
        self,
        *,
        model_dir: str,
        draft_dir: str | None = None,
        collective_timeout_s: float | None = None,
        speculative_algorithm: str | None = None,
        lora: LoraSettings | None = None,
        device: str | None = None,
        server_python: str | None = None,
        custom_weight_loaders: tuple[str, ...] = (),
    ) -> EngineSettings:
        """What launching one of these engines serving `model_dir` needs (`miles_sync.engine.kinds.engine_spec`).
        `speculative_algorithm`: `model.speculative_algorithm` (SGLang's --speculative-algorithm); `lora`: the
        adapter room an engine serving LoRA adapters reserves at start (None: base model only). `device` and
        `server_python`: `device` resolved on the launching node and the SGLang server's interpreter (launch/job.py
        resolves both; None: SGLang's default device, this interpreter)."""
        return EngineSettings(
            model_dir=model_dir,
            speculative_algorithm=speculative_algorithm,
            draft_kind=self.draft_kind,
            draft_dir=draft_dir,
            weight_layout=self.weight_layout,
            finalize_policy=self.finalize_policy,
            spec_steps=self.spec_steps,
            tp_size=self.tp,
            collective_timeout_s=collective_timeout_s,
            api_key=self.api_key,
            admin_api_key=self.admin_api_key,
            lora=lora,
            device=device,
            server_python=server_python,
            custom_weight_loaders=custom_weight_loaders,
        )


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Megatron layout of the trainer: tp x pp x dp ranks; the expert layers regroup each stage's tp x dp ranks
    as etp x ep x (expert data parallel). The rules are megatron-core's (`parallel_layout_problems`)."""

    tp: int = 2
    pp: int = 1
    dp: int = 1
    ep: int = 1
    # Expert tensor parallel; etp * ep must divide tp * dp. Default 1, not megatron's "same as tp": the trainer
    # always passes etp, so megatron's default never applies; whole experts per rank is what megatron recommends with
    # ep (no TP collectives inside each expert) and lets ep reuse the tp ranks (the main job's MoE run,
    # `model.arch=qwen3_moe trainer.ep=2`, is tp=2 x ep=2 with whole experts per rank, sequence parallel).
    etp: int = 1
    lr: float = 3e-3

    @property
    def layout_name(self) -> str:
        """The layout in a log line: TP always, every other factor where it is not 1 ("TP=2, PP=2")."""
        factors = {"TP": self.tp, "PP": self.pp, "DP": self.dp, "EP": self.ep, "ETP": self.etp}
        return ", ".join(f"{name}={value}" for name, value in factors.items() if name == "TP" or value != 1)

    @property
    def world_size(self) -> int:
        """Number of trainer ranks (actors)."""
        return self.tp * self.pp * self.dp

    def __post_init__(self) -> None:
        problems = parallel_layout_problems(tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, dp=self.dp)
        if not (self.lr > 0 and math.isfinite(self.lr)):
            problems.append(f"lr={self.lr} must be positive")
        raise_if(problems)

    def checkpoint_problems(self, hf_config: Mapping[str, Any]) -> list[str]:
        """The layout's problems with the model a checkpoint's config.json describes (its dict): decoder layers
        not divisible by pp, routed experts not divisible by ep. Pure; the job driver calls it before placement,
        when the model is known (the config alone cannot say)."""
        layers = hf_config.get("num_hidden_layers")
        experts = [n for n in (hf_config.get(key) for key in _EXPERT_COUNT_KEYS) if isinstance(n, int) and n > 0]
        return parallel_layout_problems(
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            etp=self.etp,
            dp=self.dp,
            num_layers=layers if isinstance(layers, int) else None,
            num_experts=max(experts) if experts else None,
        )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    arch: str = "qwen3"
    checkpoint_dir: str | None = None  # None: the built-in reference checkpoints (built once into the cache)
    speculative_algorithm: str | None = "NEXTN"  # None: no speculative decoding
    num_trained_mtp_layers: int = 0

    def __post_init__(self) -> None:
        problems = []
        if not self.arch.strip():
            problems.append("arch must not be empty")
        problems += selector_input_problems(
            speculative_algorithm=self.speculative_algorithm, num_trained_mtp_layers=self.num_trained_mtp_layers
        )
        raise_if(problems)


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """What each round generates: `num_prompts` per engine, each `prompt_length` tokens of the reference
    language, `samples_per_prompt` completions of each on every engine (one GRPO group per prompt: every engine's
    samples of it), `max_new_tokens` per completion at `temperature` (0: greedy, and a group's samples agree)."""

    num_prompts: int = 4
    prompt_length: int = 4
    samples_per_prompt: int = 4
    max_new_tokens: int = 24
    temperature: float = 1.0
    # Send every rollout through the SGLang router (miles_sync.engine.router), whose worker list follows each
    # sync's verdict (miles_sync.sync.routing); false: engine by engine, to the engines that serve.
    router: bool = False
    router_url: str | None = None  # a router the user runs; None: the job starts one (rollout.router=true)
    router_policy: str = "round_robin"  # the router's load-balancing policy (a router the job starts)
    # Start each round's rollouts before the trainer's step on the previous round's, so they run while it trains
    # and while the sync changes the weights under them (Miles' async mode). Samples are then off-policy by up to
    # one step: tokens before the sync come from the previous version, after it from the new one (the report
    # counts the tokens of each). Needs sync.pause_mode retract or in_place (abort would abort them).
    overlap: bool = False

    def __post_init__(self) -> None:
        counts = {
            "num_prompts": self.num_prompts,
            "prompt_length": self.prompt_length,
            "samples_per_prompt": self.samples_per_prompt,
            "max_new_tokens": self.max_new_tokens,
        }
        problems = [f"{name}={value} must be at least 1" for name, value in counts.items() if value < 1]
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            problems.append(f"temperature={self.temperature} must be a non-negative number")
        if self.router_url is not None and not self.router_url.startswith(("http://", "https://")):
            problems.append(f"router_url={self.router_url!r} must start with http:// or https://")
        if self.router_url is not None and not self.router:
            problems.append(f"router_url={self.router_url!r} is set but router=false: set router=true to use it")
        if self.router_policy not in ROUTER_POLICIES:
            problems.append(f"router_policy={self.router_policy!r} must be one of {', '.join(ROUTER_POLICIES)}")
        raise_if(problems)


# Ray's placement-group strategies.
PLACEMENT_STRATEGIES: tuple[str, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The Ray cluster and the node layout. Every listener (engine servers, stores, process groups) binds the
    address of the node it runs on (127.0.0.1 on a local cluster), or `bind_host` when set. Trainer ranks and
    engines go to nodes that carry the custom resource `trainer_node_resource` / `engine_node_resource` (each actor
    asks for 1 of it; null: any node), their placement groups placed with `trainer_strategy` / `engine_strategy`
    (colocated: one group of shared bundles, placed with `trainer_strategy`)."""

    address: str | None = None  # None: start a local Ray cluster
    num_cpus: int | None = None  # for a local cluster; None lets Ray count them
    bind_host: str | None = None  # None: each actor's own node address; "0.0.0.0" binds every interface
    trainer_node_resource: str | None = None
    engine_node_resource: str | None = None
    trainer_strategy: str = "PACK"
    engine_strategy: str = "PACK"

    def __post_init__(self) -> None:
        problems = []
        if self.num_cpus is not None and self.num_cpus < 1:
            problems.append(f"num_cpus={self.num_cpus} must be at least 1 (or null)")
        if self.bind_host is not None:
            try:
                bind_host(override=self.bind_host)
            except ValueError as exc:
                problems.append(str(exc))
        for name in ("trainer_strategy", "engine_strategy"):
            if getattr(self, name) not in PLACEMENT_STRATEGIES:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {list(PLACEMENT_STRATEGIES)}")
        for name in ("trainer_node_resource", "engine_node_resource"):
            value = getattr(self, name)
            if value is not None and (not value.strip() or value in ("CPU", "GPU")):
                problems.append(f"{name}={value!r} must name a custom node resource (not empty, CPU or GPU)")
        raise_if(problems)


@dataclass(frozen=True, kw_only=True)
class MilesSyncConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    engines: EngineConfig = field(default_factory=EngineConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: int = 0
    num_rounds: int = 10  # rounds of rollout -> reward -> policy-gradient step -> sync
    run_name: str = "default"
    output_dir: str = "outputs"  # the run writes <output_dir>/<run_name>/report.json and report.png
    control_report: str | None = None  # another run's report.json (e.g. sync.enabled=false), drawn in report.png

    def __post_init__(self) -> None:
        problems = []
        if self.seed < 0:
            problems.append(f"seed={self.seed} must be non-negative")
        if self.num_rounds < 1:
            problems.append(f"num_rounds={self.num_rounds} must be at least 1")
        if not self.run_name.strip() or "/" in self.run_name or "\\" in self.run_name:
            problems.append(f"run_name={self.run_name!r} must be a non-empty name without path separators")
        # The engine's draft and the trainer's view of speculative decoding must agree, or the selector decision
        # is made on a wrong premise.
        is_speculative = self.model.speculative_algorithm is not None
        if is_speculative != (self.engines.draft_kind is not DraftKind.NONE):
            problems.append(
                f"model.speculative_algorithm={self.model.speculative_algorithm!r} and "
                f"engines.draft_kind={self.engines.draft_kind.value!r} disagree: set both or neither"
            )
        problems += self.sync.conversion_problems(
            arch=self.model.arch, num_trained_mtp_layers=self.model.num_trained_mtp_layers
        )
        if self.sync.draft_canary is not CanaryMode.NONE and self.engines.draft_kind is DraftKind.NONE:
            problems.append(
                f"sync.draft_canary={self.sync.draft_canary.value} measures a draft's accept length; "
                "engines.draft_kind is none"
            )
        if transport_spec(self.sync.transport).spreads_feeds and self.sync.conversion is not ConversionMode.RAW:
            problems.append(
                f"sync.transport={self.sync.transport.value} sends each trainer rank's own shards: it needs "
                f"sync.conversion=raw (got {self.sync.conversion.value}); use distributed otherwise"
            )
        if self.engines.join_at_round is not None:
            if self.engines.join_at_round > self.num_rounds:
                problems.append(f"engines.join_at_round={self.engines.join_at_round} is after the last round")
            if not self.sync.enabled:
                problems.append("engines.join_at_round needs sync.enabled: a joiner serves once a sync verified it")
            if transport_spec(self.sync.transport).feeds_from_every_rank:
                problems.append(
                    f"engines.join_at_round with sync.transport={self.sync.transport.value}: the joiner is launched "
                    "outside the placement groups, with no trainer rank beside it to feed it; use distributed"
                )
        if self.rollout.overlap:
            if self.sync.pause_mode is PauseMode.ABORT:
                problems.append(
                    "rollout.overlap keeps rollouts running through the sync: sync.pause_mode=abort would abort them "
                    "(use retract or in_place)"
                )
            if self.sync.mode is SyncMode.LORA:
                problems.append(
                    "rollout.overlap with sync.mode=lora: rollouts name the adapter of one version, and the sync "
                    "replaces it under them"
                )
        if self.engines.kind is EngineKind.SGLANG and not self.engines.urls:  # what the launched servers would refuse
            problems += [
                f"engines.kind=sglang: {p} (model.speculative_algorithm, engines.draft_kind)"
                for p in sglang_speculative_problems(
                    speculative_algorithm=self.model.speculative_algorithm, draft_kind=self.engines.draft_kind
                )
            ]
        raise_if(problems)


def load_config(
    config_dir: str | Path | None = None, config_name: str = "default", overrides: Sequence[str] = ()
) -> MilesSyncConfig:
    """Read `<config_dir>/<config_name>.yaml` (default: the repository's conf/), apply dotlist overrides
    ("sync.transport=colocated") and config-group choices ("demo=frozen_draft_bug"), and return the validated
    config. Raises ValueError naming the offending key.

    The file's Hydra `defaults` list is honoured the way `launch.run` (Hydra) composes it, for the shapes conf/
    uses: `_self_` first, then `group: option` entries whose files (`<group>/<option>.yaml`) are global-package
    overrides.
    """
    directory = DEFAULT_CONFIG_DIR if config_dir is None else Path(config_dir)
    loaded = _load_yaml(directory / f"{config_name}.yaml", what=f"config {config_name!r}")
    groups = _defaults_groups(loaded, directory)
    dotted = []
    for override in _check_overrides(overrides):
        key, _, value = override.partition("=")
        if key in groups:
            groups[key] = None if value in ("null", "") else value
        else:
            dotted.append(override)
    merged: DictConfig = loaded
    for group, option in groups.items():
        if option is not None:
            path = directory / group / f"{option}.yaml"
            choices = sorted(p.stem for p in (directory / group).glob("*.yaml"))
            merged = OmegaConf.merge(merged, _load_yaml(path, what=f"{group}={option} (choices: {choices})"))
    return to_config(merged, overrides=dotted)


def _load_yaml(path: Path, *, what: str) -> DictConfig:
    if not path.is_file():
        raise ValueError(f"{what} not found: {path} is not a file")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(loaded, DictConfig):
        raise ValueError(f"config file {path} must hold a mapping at the top level")
    return loaded


def _defaults_groups(loaded: DictConfig, directory: Path) -> dict[str, str | None]:
    """Pop the Hydra defaults list off `loaded`; returns {group: option} in list order."""
    if "defaults" not in loaded:
        return {}
    entries = OmegaConf.to_container(loaded.pop("defaults"))
    groups: dict[str, str | None] = {}
    for entry in entries if isinstance(entries, list) else [entries]:
        if entry == "_self_":
            continue
        if not (isinstance(entry, dict) and len(entry) == 1):
            raise ValueError(f"defaults entry {entry!r} in {directory}: expected '_self_' or 'group: option'")
        ((group, option),) = entry.items()
        groups[str(group).removeprefix("optional ")] = None if option is None else str(option)
    return groups


def to_config(cfg: Mapping[str, Any] | DictConfig, *, overrides: Sequence[str] = ()) -> MilesSyncConfig:
    """Validate a composed config (a Hydra DictConfig or a plain mapping) plus dotlist overrides."""
    dotlist = _check_overrides(overrides)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(_schema(MilesSyncConfig)), cfg)
    except OmegaConfBaseException as e:
        raise ValueError(_describe_omegaconf_error(e)) from None
    # One override at a time, so an error can quote the override even where OmegaConf knows no key path.
    for override in dotlist:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([override]))
        except OmegaConfBaseException as e:
            key = override.partition("=")[0]
            raise ValueError(f"override {override!r}: {_describe_omegaconf_error(e, default_key=key)}") from None
    try:
        container = OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ValueError(_describe_omegaconf_error(e)) from None
    try:
        return decode(MilesSyncConfig, container)
    except ValueError as e:
        raise ValueError(str(e).replace("invalid MilesSyncConfig: ", "invalid config: ", 1)) from None


def to_yaml(config: MilesSyncConfig) -> str:
    """The YAML of a config, loadable again by load_config (for run records)."""
    return OmegaConf.to_yaml(OmegaConf.create(encode(config)))


def _check_overrides(overrides: Sequence[str]) -> list[str]:
    if isinstance(overrides, str):
        raise ValueError(f"overrides must be a sequence of 'key=value' strings, got the string {overrides!r}")
    bad = [o for o in overrides if not isinstance(o, str) or "=" not in o or o.startswith(("+", "~"))]
    if bad:
        raise ValueError(f"overrides {bad} must each be 'dotted.key=value' (adding or deleting keys is not supported)")
    return list(overrides)


def _describe_omegaconf_error(error: OmegaConfBaseException, *, default_key: str = "<root>") -> str:
    key = getattr(error, "full_key", None) or default_key
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, ConfigKeyError):
        parent, _, _ = key.rpartition(".")
        allowed = _allowed_keys(parent)
        suffix = f" (allowed under {parent or 'the top level'}: {', '.join(allowed)})" if allowed else ""
        return f"unknown config key {key!r}{suffix}"
    if isinstance(error, MissingMandatoryValue):
        return f"config key {key!r} has no value"
    return f"config key {key!r}: {reason}"


def _allowed_keys(path: str) -> list[str]:
    """Field names of the record at a dotted path of MilesSyncConfig, or [] if the path is not a record."""
    cls: Any = MilesSyncConfig
    for part in filter(None, path.split(".")):
        hint = typing.get_type_hints(cls).get(part)
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return []
        cls = hint
    return [f.name for f in dataclasses.fields(cls)]


@functools.cache
def _schema(cls: type) -> type:
    """A mutable dataclass with the fields of record `cls`, typed the way OmegaConf understands them."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = f.default
        if default is dataclasses.MISSING:
            spec = field(default=MISSING)
        else:
            spec = field(default_factory=functools.partial(_schema_value, default))
        specs.append((f.name, _schema_type(hints[f.name]), spec))
    # Same name as the record, so OmegaConf's messages read in terms the user knows.
    return dataclasses.make_dataclass(cls.__name__, specs, kw_only=True)


def _schema_type(hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return typing.Optional[_schema_type(inner)]  # noqa: UP045 - OmegaConf wants typing's generics
    if origin is tuple:
        return typing.List[_schema_type(args[0])]  # noqa: UP006 - OmegaConf wants typing's generics
    if isinstance(hint, type) and issubclass(hint, Enum):
        return str  # checked against the enum's values by the decoder, which names the allowed ones
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _schema(hint)
    return hint


def _schema_value(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_schema_value(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        values = {f.name: _schema_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return _schema(type(value))(**values)
    return value
