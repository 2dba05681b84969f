"""The reference engine's weight-update state machine: sessions, selectors, finalize policies, version, checker.

Plain class, no HTTP: `server.py` maps each endpoint onto one method. Methods return the response record on
success and raise ValueError with a message naming the problem on a request the engine refuses (the server answers
400 {success: false, message}).

Session rules:
- begin opens a session for one selector; a second begin fails; updates outside a session fail; a payload whose
  selector differs from the session's fails.
- A request is validated whole before any byte is written: names the selector does not cover, names two
  selected runners both own, shape and dtype mismatches. A name no runner has is ignored (200), as SGLang
  ignores it: a sync that sends one fails its verification, which names the tensor, not the engine. On the
  distributed path a request whose metadata describes the bytes (valid dtypes, no negative dims, aligned offsets)
  still receives them before it is refused, so the update group stays in step with the sender.
- end closes the session, always. Policy `sglang` finalizes every runner the selector covers, as SGLang does
  (a selected runner that received nothing has its already-transformed weights transformed again). Policy `strict`
  finalizes only the names loaded in the session and fails naming every selected runner that loaded nothing.

A `direct` tensor update (load_format "direct") follows SGLang's `_model_load_weights_direct` instead: payload i
carries TP rank i's own (engine parameter name, local tensor) pairs, every selected runner loads all of them as
physical bytes (a dtype is cast silently, as `copy_` casts), the runner counts as loaded in the session, and no
finalize transforms them. A name a selected runner has no parameter for, or a shape that is not its parameter's,
kills SGLang 0.5.23's whole server (measured at TP=1 and TP=2: KeyError / AssertionError in the scheduler,
SIGQUIT, the request gets no answer, /health_generate refuses connections). This engine is never kinder: it
crashes too (`EngineCrashed`; `failure` says why and everything is refused; `serve` exits the process).

Never kinder than SGLang where safety depends on it: after a failed session the engine serves whatever its runners
hold (old, new or mixed bytes), as SGLang does; `last_failure` only reports it. Generation resumes only on
/continue_generation, never by itself after a session. An update whose `flush_cache` is true fails AFTER loading
when requests are running or (unless paused) waiting, as SGLang's does; the weights stay loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_sync.engine.reference.backend import (
    AllocationError,
    EngineCrashed,
    EngineDown,
    LocalBackend,
    WeightBackend,
)
from miles_sync.engine.reference.custom_loader import CustomLoaderFailed
from miles_sync.engine.reference.lora import TENSOR_LORA_PATH
from miles_sync.engine.reference.runner import dtype_str
from miles_sync.engine.reference.runner_api import ServedRunner
from miles_sync.engine.reference.scheduler import Scheduler
from miles_sync.engine.settings import FinalizePolicy
from miles_sync.weights.checksum import TensorHash, sglang_parameter_names
from miles_sync.wire.bucket import BucketEntry, TensorMeta, layout_from_metadata
from miles_sync.wire.draft import DraftKind, DraftReport
from miles_sync.wire.dtypes import dtype_from_name
from miles_sync.wire.protocol import (
    BeginWeightUpdateRequest,
    ChecksumNames,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    FlushCacheResult,
    GenerateRequest,
    GenerationControlResult,
    InitWeightsUpdateGroupRequest,
    LoadFormat,
    LoadLoRAAdapterFromTensorsRequest,
    LoRAUpdateResult,
    ModelInfo,
    PauseGenerationRequest,
    Role,
    Selector,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsCheckerRequest,
    WeightsCheckerResult,
    WeightUpdateResult,
    WeightVersionResult,
    role_kind,
    selector_roles,
)
from miles_sync.wire.text import raise_if, shorten

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

logger = logging.getLogger(__name__)

_MAX_PROBLEMS_SHOWN = 8


@dataclass(kw_only=True)
class _Session:
    selector: Selector
    runners: tuple[ServedRunner, ...]
    failures: list[str] = field(default_factory=list)

    def has_loaded(self) -> bool:
        return any(runner.loaded_in_session() or runner.loaded_direct_in_session() for runner in self.runners)


class ReferenceEngine:
    """The weight-update side of one reference engine: a target runner, at most one draft, one scheduler.

    Thread-safe: weight operations (sessions, updates, checker, version, group teardown) are serialized by one lock
    taken with a timeout; generation requests and reads never wait for it. Creating an update group blocks until
    the rendezvous completes, outside that lock.
    """

    def __init__(
        self,
        *,
        target: ServedRunner,
        draft: ServedRunner | None,
        draft_kind: DraftKind,
        scheduler: Scheduler,
        model_path: str,
        finalize_policy: FinalizePolicy = FinalizePolicy.STRICT,
        collective_timeout_s: float = 120.0,
        draft_is_frozen: bool = False,
        checksum_names: ChecksumNames = ChecksumNames.HF,
        tensor_hash: TensorHash = TensorHash.SHA256,
        draft_role: str = Role.DRAFT.value,
        backend: WeightBackend | None = None,
        adapters: Any = None,
        custom_weight_loaders: Sequence[str] = (),
    ) -> None:
        """`adapters`: the LoRA adapters of the target (miles_sync.engine.reference.lora LocalAdapters or
        RankAdapters; None: LoRA is not enabled, as SGLang without --enable-lora). `custom_weight_loaders`: the
        import paths a tensor update may name as its load_format (SGLang's `--custom-weight-loader`)."""
        self._custom_weight_loaders = frozenset(custom_weight_loaders)
        draft_kind = DraftKind(draft_kind)
        problems = []
        try:
            if role_kind(draft_role) is not Role.DRAFT:
                problems.append(f"draft_role {draft_role!r} is not a draft role")
        except ValueError as exc:
            problems.append(f"draft_role: {exc}")
        if target.role is not Role.TARGET:
            problems.append(f"target runner has role {target.role.value!r}")
        if (draft is not None) != (draft_kind in (DraftKind.MTP, DraftKind.STANDALONE)):
            problems.append(f"draft_kind {draft_kind.value!r} with{'' if draft is not None else 'out'} a draft runner")
        if collective_timeout_s <= 0:
            problems.append(f"collective_timeout_s={collective_timeout_s} must be > 0")
        raise_if(problems, what="invalid reference engine")
        self._runners: dict[Role, ServedRunner] = {Role.TARGET: target}
        if draft is not None:
            self._runners[Role.DRAFT] = draft
        self._draft_kind = draft_kind
        self._draft_is_frozen = draft_is_frozen
        self._scheduler = scheduler
        self._model_path = model_path
        self._checkpoint_config = _checkpoint_config(model_path)  # /model_info answers from it, as SGLang does
        self._policy = FinalizePolicy(finalize_policy)
        self._timeout_s = collective_timeout_s
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._last_failure: str | None = None
        self._crash: str | None = None  # why the engine crashed as SGLang's server would; it never serves again
        self._draft_role = draft_role
        self._adapters = adapters
        # TP=1 runners live here; a multi-rank engine passes the backend that drives its rank processes.
        self._backend: WeightBackend = backend or LocalBackend(
            self._runners,
            timeout_s=collective_timeout_s,
            checksum_names=checksum_names,
            draft_role=draft_role,
            tensor_hash=tensor_hash,
        )

    # ---- state -------------------------------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._scheduler.weight_version

    @property
    def last_failure(self) -> str | None:
        """Why the last weight update session failed, None once a later session ended successfully. A diagnostic
        only: the engine serves whatever its runners hold either way, as SGLang does."""
        return self._last_failure

    @property
    def checksum_names(self) -> ChecksumNames:
        """What /weights_checker checksum answers: HF names and logical bytes, or SGLang's engine names and bytes."""
        return self._backend.checksum_names

    def received_bytes(self) -> tuple[int, ...]:
        """Per TP rank, the bytes of tensor data it took in since start (see LocalBackend.received_bytes). Takes no
        engine lock: a multi-rank engine's control channel serializes it with the weight operations."""
        return self._backend.received_bytes()

    @property
    def tensor_hash(self) -> TensorHash:
        """How /weights_checker's engine-named digests are computed (SGLang's CPU or GPU tensor hash)."""
        return self._backend.tensor_hash

    @property
    def tp_size(self) -> int:
        return self._backend.tp_size

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer serve at all (a TP rank died, or a request crashed it as it crashes SGLang),
        None while it can."""
        return self._crash if self._crash is not None else self._backend.failure

    @property
    def draft_role(self) -> str:
        """The draft runner's role name in checker answers ("draft", or "draft_step_0" as multi-layer EAGLE)."""
        return self._draft_role

    @property
    def finalize_policy(self) -> FinalizePolicy:
        return self._policy

    @property
    def is_paused(self) -> bool:
        return self._scheduler.is_paused

    def runner(self, role: Role) -> ServedRunner | None:
        """The runner playing `role`, or None (no draft runner for draft kinds none and ngram)."""
        return self._runners.get(Role(role))

    def draft_report(self) -> DraftReport:
        draft = self._runners.get(Role.DRAFT)
        owned = () if draft is None else tuple(sorted(draft.owned_names()))
        return DraftReport(kind=self._draft_kind, owned_names=owned, is_frozen=self._draft_is_frozen)

    def model_info(self) -> ModelInfo:
        # As SGLang answers: the tokenizer at the model path (its --tokenizer-path default) and the checkpoint's
        # config.json model_type and architectures.
        config = self._checkpoint_config
        architectures = config.get("architectures")
        return ModelInfo(
            model_path=self._model_path,
            weight_version=self.weight_version,
            tokenizer_path=self._model_path,
            model_type=config.get("model_type"),
            architectures=None if architectures is None else tuple(architectures),
        )

    # ---- sessions ----------------------------------------------------------------------------------------------

    def begin_weight_update(self, request: BeginWeightUpdateRequest) -> WeightUpdateResult:
        with self._locked("begin_weight_update"):
            if self._session is not None:
                raise ValueError(
                    f"a weight update session with selector {self._session.selector.value!r} is already open; "
                    f"end it with /end_weight_update first"
                )
            runners = self._select(request.selector)
            for runner in runners:
                runner.reset_session()
            self._session = _Session(selector=request.selector, runners=runners)
        return WeightUpdateResult(success=True, message=f"weight update session open for {_describe(runners)}")

    def end_weight_update(self, request: EndWeightUpdateRequest) -> WeightUpdateResult:
        del request  # no fields
        with self._locked("end_weight_update"):
            session = self._session
            if session is None:
                raise ValueError("no weight update session is open: call /begin_weight_update first")
            self._session = None
            try:
                problems = list(session.failures) + self._finalize(session)
                finalized_any = session.has_loaded() or self._policy is not FinalizePolicy.STRICT
            except Exception as exc:  # an engine fault mid-finalize: layouts may now be mixed
                self._record_failure(f"finalize failed: {exc}")
                raise
            finally:
                loaded = {
                    runner.role.value: len(runner.loaded_in_session() | runner.loaded_direct_in_session())
                    for runner in session.runners
                }
                for runner in session.runners:
                    runner.reset_session()
            if finalized_any:
                self._scheduler.invalidate_cache()
            if problems:
                message = "weight update session failed: " + shorten(problems, limit=_MAX_PROBLEMS_SHOWN, sep="; ")
                self._record_failure(f"selector {session.selector.value!r}, tensors loaded {loaded}: {message}")
                raise ValueError(message)
            self._last_failure = None
        return WeightUpdateResult(success=True, message=f"session finalized; tensors loaded per role: {loaded}")

    def _finalize(self, session: _Session) -> list[str]:
        """Post-process the session's runners per policy; returns the problems (strict: runners that loaded nothing)."""
        problems = []
        for runner in session.runners:
            if self._policy is not FinalizePolicy.STRICT:
                runner.finalize_all()
                continue
            loaded = runner.loaded_in_session()
            partial = runner.partially_loaded()
            if partial:
                # A TP engine fuses q/k/v and gate/up into one parameter: transforming one whose other parts still
                # hold post-processed bytes would transform those twice.
                parts = sglang_parameter_names(runner.owned_names())
                loaded = loaded - {name for fused in partial for name in parts[fused]}
                problems.append(
                    f"the {runner.role.value} runner loaded only some parts of the fused parameter(s) "
                    f"{shorten(partial, limit=_MAX_PROBLEMS_SHOWN)}; the strict finalize policy leaves them untouched"
                )
            if loaded:
                runner.finalize(sorted(loaded))
            elif partial or runner.loaded_direct_in_session():
                continue  # a direct load's bytes are physical: SGLang post-processes nothing after one
            else:
                hint = " (a frozen draft needs selector 'target')" if runner.role is Role.DRAFT else ""
                problems.append(
                    f"the {runner.role.value} runner is selected by {session.selector.value!r} but loaded no tensor "
                    f"in this session; the strict finalize policy leaves its weights untouched instead of "
                    f"transforming them again{hint}"
                )
        return problems

    def _select(self, selector: Selector) -> tuple[ServedRunner, ...]:
        # A server without selector support puts every runner in every session, whatever the request says.
        roles = selector_roles(Selector.ALL if self._policy is FinalizePolicy.NO_SELECTOR else selector)
        runners = tuple(
            self._runners[role] for role in (Role.TARGET, Role.DRAFT) if role in roles and role in self._runners
        )
        if not runners:
            raise ValueError(
                f"selector {selector.value!r} covers no runner: this engine has no draft runner "
                f"(draft kind {self._draft_kind.value!r})"
            )
        return runners

    # ---- updates -----------------------------------------------------------------------------------------------

    def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest) -> WeightUpdateResult:
        endpoint = "/update_weights_from_distributed"
        with self._update_step(endpoint, request.selector) as session:
            # Checks that decide whether the bytes can be received at all: failing them, nothing is received.
            entries = self._receive_layout(request)
            problems = self._payload_problems(session, [_meta(e) for e in entries])
            is_bucket = request.load_format is LoadFormat.FLATTENED_BUCKET
            try:
                staged = self._backend.receive(request.group_name, entries, is_bucket=is_bucket)
            except AllocationError as exc:  # before the first byte: the group is still usable
                raise ValueError(str(exc)) from None
            result = self._load(session, staged, problems, endpoint=endpoint, request=request)
        return self._flush_after_update(result, endpoint=endpoint, flush_cache=request.flush_cache)

    def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest) -> WeightUpdateResult:
        endpoint = "/update_weights_from_tensor"
        with self._update_step(endpoint, request.selector) as session:
            if request.load_format is LoadFormat.DIRECT:
                result = self._load_direct(session, endpoint=endpoint, request=request)
            elif request.load_format is not None and not isinstance(request.load_format, LoadFormat):
                result = self._load_custom(session, endpoint=endpoint, request=request, path=request.load_format)
            else:
                load_format = None if request.load_format is None else request.load_format.value
                staged, metas = self._backend.decode(request.serialized_named_tensors, load_format=load_format)
                problems = self._payload_problems(session, metas)
                result = self._load(session, staged, problems, endpoint=endpoint, request=request)
        return self._flush_after_update(result, endpoint=endpoint, flush_cache=request.flush_cache)

    def _load_direct(
        self, session: _Session, *, endpoint: str, request: UpdateWeightsFromTensorRequest
    ) -> WeightUpdateResult:
        """Payload i into every selected runner of rank i, as SGLang's direct loader (see the module docstring).
        A payload that does not decode is refused (400) as for every load format; one SGLang dies on crashes the
        engine: nothing is written (SGLang may have written earlier tensors, but never serves them again)."""
        try:
            staged = self._backend.stage_direct(session.runners, request.serialized_named_tensors)
        except EngineCrashed as exc:
            self._crash = f"{endpoint} (load_format 'direct') crashed the engine, as it crashes SGLang's: {exc}"
            logger.critical("%s", self._crash)
            raise EngineCrashed(self._crash) from None
        if request.abort_all_requests:
            self._scheduler.abort_all(f"aborted by {endpoint}(abort_all_requests=true)")
        num_loaded = self._backend.load_direct(session.runners, staged)
        if request.weight_version is not None:
            self._scheduler.set_weight_version(request.weight_version)
        return WeightUpdateResult(success=True, message=f"loaded parameter(s) direct per role: {num_loaded}")

    def _load_custom(
        self, session: _Session, *, endpoint: str, request: UpdateWeightsFromTensorRequest, path: str
    ) -> WeightUpdateResult:
        """SGLang's custom weight loader: `path` must be one the engine was started with (`--custom-weight-loader`);
        any other ends SGLang's scheduler (`NotImplementedError: Unknown load_format`), and so crashes this engine.
        Every TP rank runs the loader on its own payload, once per selected runner, as SGLang does; what it wrote
        counts as a direct load (custom_loader module)."""
        if path not in self._custom_weight_loaders:
            self._crash = f"{endpoint} crashed the engine, as it crashes SGLang's: Unknown load_format={path}"
            logger.critical("%s", self._crash)
            raise EngineCrashed(self._crash)
        if request.abort_all_requests:
            self._scheduler.abort_all(f"aborted by {endpoint}(abort_all_requests=true)")
        try:
            num_loaded = self._backend.load_custom(session.runners, request.serialized_named_tensors, path=path)
        except CustomLoaderFailed as exc:
            self._crash = f"{endpoint} (custom loader {path}) crashed the engine, as it crashes SGLang's: {exc}"
            logger.critical("%s", self._crash)
            raise EngineCrashed(self._crash) from None
        if request.weight_version is not None:
            self._scheduler.set_weight_version(request.weight_version)
        return WeightUpdateResult(success=True, message=f"custom loader {path} ran per role: {num_loaded}")

    @contextlib.contextmanager
    def _update_step(self, endpoint: str, selector: Selector) -> Iterator[_Session]:
        """One payload of the open session; any failure is recorded on the session and re-raised naming `endpoint`."""
        with self._locked(endpoint):
            session = self._session
            if session is None:
                raise ValueError(f"{endpoint} needs an open weight update session: call /begin_weight_update first")
            try:
                if selector != session.selector:
                    raise ValueError(
                        f"payload selector {selector.value!r} differs from the open session's selector "
                        f"{session.selector.value!r}; begin, every payload and end must carry the same selector"
                    )
                yield session
            except Exception as exc:
                self._fail(session, f"{endpoint}: {exc}")
                if isinstance(exc, ValueError):
                    raise ValueError(f"{endpoint} refused: {exc}") from None
                raise

    def _receive_layout(self, request: UpdateWeightsFromDistributedRequest) -> tuple[BucketEntry, ...]:
        if not request.names:
            raise ValueError("names is empty; a payload carries at least one tensor")
        if request.load_format is LoadFormat.FLATTENED_BUCKET:
            return layout_from_metadata(names=request.names, dtypes=request.dtypes, shapes=request.shapes)
        # Per-tensor: each tensor is its own broadcast, so only dtype names and dims need checking.
        entries = []
        negative = [f"{n} {list(s)}" for n, s in zip(request.names, request.shapes) if any(d < 0 for d in s)]
        if negative:
            raise ValueError(f"Negative dimension in received tensor(s): {'; '.join(negative)}")
        for name, dtype, shape in zip(request.names, request.dtypes, request.shapes):
            meta = TensorMeta(name=name, shape=tuple(shape), dtype=dtype_from_name(dtype))
            entries.append(BucketEntry(name=name, shape=meta.shape, dtype=meta.dtype, start=0, end=meta.num_bytes))
        return tuple(entries)

    def _payload_problems(self, session: _Session, metas: Sequence[TensorMeta]) -> list[str]:
        """Everything wrong with a payload for this session's runners; empty when every runner can load it."""
        problems = []
        seen: set[str] = set()
        selected = {runner.role for runner in session.runners}
        for meta in metas:
            if meta.name in seen:
                problems.append(f"tensor {meta.name!r} appears twice in the payload")
            seen.add(meta.name)
            owners = [role for role, runner in self._runners.items() if meta.name in runner.owned_names()]
            covered = [role for role in owners if role in selected]
            if not owners:
                logger.warning("ignoring tensor %r: no runner of this engine has it (as SGLang ignores it)", meta.name)
            elif not covered:
                problems.append(
                    f"tensor {meta.name!r} belongs to the {owners[0].value} runner, which selector "
                    f"{session.selector.value!r} does not cover"
                )
            elif len(covered) > 1:
                problems.append(
                    f"tensor {meta.name!r} is owned by both the target and the {self._draft_kind.value} draft "
                    f"runner: selector {session.selector.value!r} would load one tensor into two different models; "
                    f"update them in separate sessions with selectors 'target' and 'draft'"
                )
            for role in covered:
                expected = self._runners[role].expected(meta.name)
                if expected.shape != meta.shape or expected.dtype != meta.dtype:
                    problems.append(
                        f"tensor {meta.name!r} for the {role.value} runner: expected shape {list(expected.shape)} "
                        f"dtype {dtype_str(expected.dtype)}, got shape {list(meta.shape)} dtype {dtype_str(meta.dtype)}"
                    )
        return problems

    def _load(self, session: _Session, staged, problems: list[str], *, endpoint: str, request) -> WeightUpdateResult:
        if problems:
            self._backend.discard(staged)
            raise ValueError(f"no weight changed: {shorten(problems, limit=_MAX_PROBLEMS_SHOWN, sep='; ')}")
        if request.abort_all_requests:
            self._scheduler.abort_all(f"aborted by {endpoint}(abort_all_requests=true)")
        # Validated above: a load that raises now is an engine fault, and earlier runners may hold the new bytes
        # (the session records the failure; the engine serves them anyway, as SGLang would).
        num_loaded = self._backend.load(session.runners, staged)
        if request.weight_version is not None:
            self._scheduler.set_weight_version(request.weight_version)
        return WeightUpdateResult(success=True, message=f"loaded tensor(s) per role: {num_loaded}")

    def _flush_after_update(
        self, result: WeightUpdateResult, *, endpoint: str, flush_cache: bool
    ) -> WeightUpdateResult:
        """SGLang's flush_cache_after_weight_update: the weights are loaded either way; with requests running (or
        waiting, unless paused) the cache cannot be flushed and the call fails. Not a session failure: a later
        /flush_cache completes it."""
        if not flush_cache:
            return result
        running, waiting = self._busy()
        if running or waiting:
            raise ValueError(
                f"{endpoint}: Weights were updated, but the cache was not flushed because requests are still running "
                f"or queued ({running} running, {waiting} waiting). Retract or finish them, then call /flush_cache."
            )
        self._scheduler.invalidate_cache()
        return result

    def _busy(self) -> tuple[int, int]:
        """(running, waiting) requests that block a cache flush; waiting ones do not count while paused."""
        waiting = 0 if self._scheduler.is_paused else self._scheduler.num_waiting
        return self._scheduler.num_running, waiting

    def _fail(self, session: _Session, message: str) -> None:
        session.failures.append(message)
        self._record_failure(message)

    def _record_failure(self, message: str) -> None:
        self._last_failure = message
        logger.warning("weight update failed: %s", message)

    # ---- LoRA adapters -----------------------------------------------------------------------------------------
    # Outside any update session, as SGLang: an adapter load carries no selector, finalizes nothing, and reaches the
    # target's adapters only (never a draft runner).

    def load_lora_adapter_from_tensors(self, request: LoadLoRAAdapterFromTensorsRequest) -> LoRAUpdateResult:
        """Load a named adapter; a refused load (checksums, config, name already loaded, shapes) answers success
        false naming the problem and leaves every loaded adapter serving."""
        adapters = self._require_adapters()
        load_format = None if request.load_format is None else request.load_format.value
        try:
            with self._locked("load_lora_adapter_from_tensors"), self._runners[Role.TARGET].weights_lock:
                adapters.load(
                    request.lora_name,
                    payloads=request.serialized_named_tensors,
                    load_format=load_format,
                    config_dict=request.config_dict,
                    expected_checksums=request.expected_checksums,
                    added_tokens_config=request.added_tokens_config,
                )
                self._scheduler.invalidate_cache()
        except ValueError as exc:
            logger.warning("load_lora_adapter_from_tensors %r refused: %s", request.lora_name, exc)
            return LoRAUpdateResult(success=False, error_message=str(exc), loaded_adapters=self._loaded(adapters))
        return LoRAUpdateResult(success=True, loaded_adapters=self._loaded(adapters))

    def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> LoRAUpdateResult:
        adapters = self._require_adapters()
        try:
            with self._locked("unload_lora_adapter"), self._runners[Role.TARGET].weights_lock:
                adapters.unload(request.lora_name)
                self._scheduler.invalidate_cache()
        except ValueError as exc:
            return LoRAUpdateResult(success=False, error_message=str(exc), loaded_adapters=self._loaded(adapters))
        return LoRAUpdateResult(success=True, loaded_adapters=self._loaded(adapters))

    def _require_adapters(self) -> Any:
        if self._adapters is None:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        return self._adapters

    @staticmethod
    def _loaded(adapters: Any) -> dict[str, str]:
        return {name: TENSOR_LORA_PATH for name in adapters.names}

    # ---- update groups -----------------------------------------------------------------------------------------

    def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest) -> WeightUpdateResult:
        """Join the group, every TP rank at rank_offset + tp_rank; blocks until the rendezvous completes (run it
        off the server's event loop)."""
        message = self._backend.join_group(
            master_address=request.master_address,
            master_port=request.master_port,
            rank_offset=request.rank_offset,
            world_size=request.world_size,
            group_name=request.group_name,
            backend=request.backend,
        )
        return WeightUpdateResult(success=True, message=message)

    def destroy_weights_update_group(self, request: DestroyWeightsUpdateGroupRequest) -> WeightUpdateResult:
        # Under the engine lock: never tear a group down under a payload that is receiving on it.
        with self._locked("destroy_weights_update_group"):
            self._backend.destroy_group(request.group_name)
        return WeightUpdateResult(success=True, message=f"destroyed {request.group_name!r}")

    def shutdown(self) -> None:
        self._scheduler.shutdown()
        self._backend.close()

    # ---- version, checker --------------------------------------------------------------------------------------

    def update_weight_version(self, request: UpdateWeightVersionRequest) -> WeightVersionResult:
        with self._locked("update_weight_version"):
            if request.abort_all_requests:
                self._scheduler.abort_all("aborted by update_weight_version(abort_all_requests=true)")
            self._scheduler.set_weight_version(request.new_version)
        return WeightVersionResult(success=True, message="weight version updated", new_version=request.new_version)

    def weights_checker(self, request: WeightsCheckerRequest) -> WeightsCheckerResult:
        with self._locked("weights_checker"):
            roles = {runner.role for runner in self._select(request.selector)}
            # reset_tensors is SGLang's test hook: random weights keep serving, open session or not.
            return self._backend.check(request, roles=roles)

    # ---- generation --------------------------------------------------------------------------------------------

    def submit_generate(self, request: GenerateRequest) -> Future:
        """Queue a generation (it waits while paused); raises ValueError for a bad request, EngineDown when the
        engine's ranks are gone."""
        if self.failure is not None:
            raise EngineDown(f"the engine is down: {self.failure}")
        return self._scheduler.submit(request)

    def pause_generation(self, request: PauseGenerationRequest) -> GenerationControlResult:
        self._scheduler.pause(request.mode, timeout_s=self._timeout_s)
        return GenerationControlResult(message=f"generation paused (mode {request.mode.value})", status="ok")

    def continue_generation(self, request: ContinueGenerationRequest) -> GenerationControlResult:
        del request  # torch_empty_cache: nothing to release on CPU
        # The only place generation resumes: sessions, failures and checker actions leave a pause in place.
        self._scheduler.resume()
        return GenerationControlResult(message="generation continued", status="ok")

    def flush_cache(self) -> FlushCacheResult:
        """Drop caches computed from the weights. Answers at once: 400 while requests run (waiting ones count
        unless paused); callers retry while requests drain after a pause."""
        running, waiting = self._busy()
        if running or waiting:
            return FlushCacheResult(
                status_code=400, message=f"Cache not flushed: {running} request(s) running, {waiting} waiting."
            )
        self._scheduler.invalidate_cache()
        return FlushCacheResult(status_code=200, message="Cache flushed.")

    def load_state(self) -> dict[str, float | int | str | None]:
        """Live numbers for /get_server_info: running mean accept length, queue sizes, the last session failure."""
        return {
            "avg_spec_accept_length": self._scheduler.avg_spec_accept_length,
            "num_running": self._scheduler.num_running,
            "num_waiting": self._scheduler.num_waiting,
            "last_failure": self._last_failure,
            "engine_failure": self.failure,
            "tp_rank_pids": list(self._backend.rank_pids),
        }

    # ---- plumbing ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, what: str) -> Iterator[None]:
        # A collective can legitimately take up to the timeout; waiting longer than that means something is stuck.
        if not self._lock.acquire(timeout=self._timeout_s + 5.0):
            raise TimeoutError(f"{what}: another weight operation held the engine for over {self._timeout_s} s")
        try:
            if self._crash is not None:
                raise EngineDown(f"{what}: the engine is down: {self._crash}")
            yield
        finally:
            self._lock.release()


def _meta(entry: BucketEntry) -> TensorMeta:
    return TensorMeta(name=entry.name, shape=entry.shape, dtype=entry.dtype)


def _describe(runners: Sequence[ServedRunner]) -> str:
    return " and ".join(f"the {runner.role.value} runner" for runner in runners)


def _checkpoint_config(model_path: str) -> dict[str, Any]:
    """The checkpoint's config.json ({} when the path holds none)."""
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
