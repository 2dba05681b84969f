"""The generation scheduler: a request queue and one thread that decodes every running request in one batch per step.

Each step: admit waiting requests, let the draft propose (if any), score every sequence plus its proposal in ONE
right-padded target forward, keep what `accept_tokens` accepts, complete finished requests. There is no KV cache;
the one cache is each sequence's target hidden states, which the MTP draft reads. It is stamped with the weights
epoch of the runners, so states computed with old weights are never used, and `invalidate_cache` drops it outright.

Threading: `_cond` guards the queues and flags; the weights lock of the runners is held for the whole of every
forward step, so a weight write never interleaves with a forward. Never call `pause` while holding the weights
lock: pause waits for the step in flight to end, and that step may be waiting for the lock.

Logprobs (`return_logprob`): every emitted token, whether the target chose it alone or accepted it from a draft,
gets `token_logprob` of the target's logits at the position that predicted it, the row `choose_token` drew from.
That is SGLang's quantity on both of its paths: plain decoding (srt/layers/sampler.py:281-318, log of the
temperature-scaled softmax) and speculative verification (srt/layers/logprob_processor.py:386-432,
`compute_spec_logprobs`: log_softmax of the target's verify logits at the accepted positions, called by the
EAGLE/MTP and standalone workers, srt/speculative/eagle_worker_common.py:769-770, and the ngram worker,
srt/speculative/ngram_worker.py:516). Every TP size computes it here, from the full logits rank 0 answers.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_sync.engine.reference.models import TextCodec
from miles_sync.engine.reference.runner_api import ServedRunner
from miles_sync.engine.reference.sampling import choose_token, is_greedy, logprob_problems, token_logprob
from miles_sync.engine.reference.speculative import DraftInput, Proposer, accept_tokens, create_proposer, pad_right
from miles_sync.wire.protocol import (
    FinishReason,
    FinishReasonKind,
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
    PauseMode,
    Role,
    SamplingParams,
    WeightVersionSpan,
)
from miles_sync.wire.text import raise_if

__all__: list[str] = []  # nothing here is imported from outside miles_sync.engine

_LOCK_POLL_S = 0.5  # how often a loop waiting for the weights lock checks for shutdown


@dataclass(eq=False)
class _Sequence:
    """Mutable state of one request; only the loop thread (or a caller holding `_cond`) touches it."""

    request: GenerateRequest
    future: Future
    prompt_ids: list[int]
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # one per output id, only with return_logprob
    target_hidden: torch.Tensor | None = None
    hidden_epoch: int = -1
    # [version, start, end) spans of output tokens, as SGLang's compute_weight_version_spans builds them.
    version_spans: list[WeightVersionSpan] = field(default_factory=list)
    num_verify: int = 0
    num_proposed: int = 0
    num_accepted: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)


@dataclass(frozen=True, kw_only=True)
class _StepResult:
    emitted: list[int]
    logprobs: list[float]  # one per emitted token with return_logprob, else empty
    num_proposed: int
    num_accepted: int
    target_hidden: torch.Tensor | None


class Scheduler:
    """Batched generation over a target runner and an optional draft.

    draft_kind: "none", "mtp" (draft = MTP runner), "standalone" (draft = causal LM runner), "ngram" (no runner).
    `tokenizer` (models.load_tokenizer) enables `text` prompts and fills the response text.
    `submit` validates the request and returns a Future of its GenerateResponse. Pause modes: abort completes
    in-flight requests now (finish reason abort); retract moves running requests back to the queue (tokens kept,
    caches dropped) until `resume`; in_place keeps them where they are. `pause` returns once no forward is in
    flight, so weights can be written safely afterwards.
    """

    def __init__(
        self,
        *,
        target: ServedRunner,
        draft: ServedRunner | None = None,
        draft_kind: str = "none",
        spec_steps: int = 3,
        max_running: int = 64,
        weight_version: str = "default",
        tokenizer: TextCodec | None = None,
        spec_window: int = 64,
        adapters: Any = None,
    ) -> None:
        kind = str(getattr(draft_kind, "value", draft_kind))
        problems = []
        if target.role is not Role.TARGET:
            problems.append(f"target runner has role {target.role.value!r}")
        if draft is not None and draft.role is not Role.DRAFT:
            problems.append(f"draft runner has role {draft.role.value!r}")
        if max_running < 1:
            problems.append(f"max_running={max_running} must be at least 1")
        if kind == "none" and draft is not None:
            problems.append("draft_kind 'none' with a draft runner")
        raise_if(problems, what="invalid scheduler")
        self._target = target
        self._draft = draft
        self._proposer: Proposer | None = (
            None if kind == "none" else create_proposer(kind, target=target, draft=draft, num_steps=spec_steps)
        )
        self.draft_kind = kind
        self._tokenizer = tokenizer
        self._max_running = max_running
        config = target.model.config
        self._vocab_size = config.vocab_size
        self._max_positions = config.max_position_embeddings
        eos = getattr(config, "eos_token_id", None)
        self._eos_ids = frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._paused = False
        self._stopping = False
        self._in_step = False
        self._weight_version = weight_version
        # LoRA adapters of the target (reference/lora.py; None: not enabled). Only the target's forward serves them:
        # a speculative draft proposes with its own weights, as in SGLang.
        self._adapters = adapters
        self._spec_window: collections.deque[tuple[int, int]] = collections.deque(maxlen=spec_window)
        self._thread = threading.Thread(target=self._loop, name="reference-scheduler", daemon=True)
        self._thread.start()

    # ---- requests ---------------------------------------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> Future:
        """Queue a request; the Future resolves to a GenerateResponse. Raises ValueError for a bad request."""
        prompt = self._prompt_ids(request)
        params = request.sampling_params
        generator = None
        if not is_greedy(params):
            generator = torch.Generator()
            if params.sampling_seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.sampling_seed)
        seq = _Sequence(request=request, future=Future(), prompt_ids=prompt, generator=generator)
        seq.future.set_running_or_notify_cancel()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the scheduler is shut down")
            self._waiting.append(seq)
            self._cond.notify_all()
        return seq.future

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.input_ids is not None:
            prompt = list(request.input_ids)
        elif self._tokenizer is None:
            raise ValueError("this model has no tokenizer: send input_ids instead of text")
        else:
            prompt = list(self._tokenizer.encode(request.text))
        problems = []
        if not prompt:
            problems.append("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self._vocab_size]
        if bad:
            problems.append(f"token ids {bad[:5]} are outside the vocabulary [0, {self._vocab_size})")
        total = len(prompt) + request.sampling_params.max_new_tokens
        if total > self._max_positions:
            problems.append(
                f"prompt length {len(prompt)} + max_new_tokens {request.sampling_params.max_new_tokens} exceeds "
                f"the model's max_position_embeddings {self._max_positions}"
            )
        problems += logprob_problems(request)
        if request.lora_path is not None:
            if self._adapters is None:
                problems.append(f"lora_path {request.lora_path!r}: LoRA is not enabled (--enable-lora)")
            elif request.lora_path not in self._adapters.names:
                problems.append(
                    f"lora_path {request.lora_path!r}: the following requested LoRA adapters are not loaded "
                    f"(loaded: {sorted(self._adapters.names)})"
                )
        raise_if(problems, what="invalid generate request")
        return prompt

    # ---- control ----------------------------------------------------------------------------------------------

    def pause(self, mode: PauseMode = PauseMode.ABORT, *, timeout_s: float = 60.0) -> None:
        """Stop decoding; returns once no forward step is in flight. See the class docstring for the modes."""
        mode = PauseMode(mode)
        finished: list[tuple[_Sequence, GenerateResponse]] = []
        with self._cond:
            self._paused = True
            if not self._cond.wait_for(lambda: not self._in_step, timeout=timeout_s):
                raise TimeoutError(f"a forward step did not finish within {timeout_s} s of pause({mode.value})")
            if mode is PauseMode.ABORT:
                finished = self._abort_locked("aborted by pause_generation(mode='abort')")
            elif mode is PauseMode.RETRACT:
                # Front of the queue, in their original order: they resume first, with every token kept.
                for seq in reversed(self._running):
                    seq.target_hidden = None
                    self._waiting.appendleft(seq)
                self._running.clear()
        self._resolve(finished)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def abort_all(self, message: str = "aborted") -> int:
        """Complete every running and waiting request now with finish reason abort; returns how many."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._in_step, timeout=60.0):
                raise TimeoutError("a forward step did not finish within 60 s of abort_all")
            finished = self._abort_locked(message)
        self._resolve(finished)
        return len(finished)

    def invalidate_cache(self) -> None:
        """Drop every cache computed from the weights (the per-sequence target hidden states)."""
        with self._cond:
            for seq in [*self._running, *self._waiting]:
                seq.target_hidden = None

    def set_weight_version(self, version: str) -> None:
        with self._cond:
            self._weight_version = version

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def avg_spec_accept_length(self) -> float | None:
        """Tokens per verify step over the last `spec_window` completed requests; None without speculative
        decoding or before any request completed."""
        with self._cond:
            if self._proposer is None or not self._spec_window:
                return None
            tokens = sum(t for t, _ in self._spec_window)
            verifies = sum(v for _, v in self._spec_window)
        return tokens / verifies if verifies else 1.0

    def reset_spec_stats(self) -> None:
        with self._cond:
            self._spec_window.clear()

    def shutdown(self, *, timeout_s: float = 30.0) -> None:
        """Abort everything still queued or running and stop the loop thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)
        with self._cond:
            finished = self._abort_locked("the engine is shutting down")
        self._resolve(finished)

    # ---- the loop ---------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            finished: list[tuple[_Sequence, GenerateResponse]] = []
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopping or (not self._paused and (self._waiting or self._running)), timeout=1.0
                )
                if self._stopping:
                    return
                if self._paused or not (self._waiting or self._running):
                    continue
                while self._waiting and len(self._running) < self._max_running:
                    self._running.append(self._waiting.popleft())
                finished += self._complete_locked([s for s in self._running if s.remaining <= 0])
                batch = list(self._running)
                version = self._weight_version
                self._in_step = bool(batch)
            results: list[_StepResult] | None = None
            try:
                if batch:
                    results = self._step(batch)
            except Exception as error:  # a failed step fails its requests, never the loop
                with self._cond:
                    self._running = [s for s in self._running if s not in batch]
                for seq in batch:
                    if not seq.future.done():
                        seq.future.set_exception(error)
            with self._cond:
                if batch and results is not None:
                    for seq, result in zip(batch, results):
                        self._apply(seq, result, version)
                    finished += self._complete_locked([s for s in self._running if self._is_finished(s)])
                self._in_step = False
                self._cond.notify_all()
            self._resolve(finished)

    @contextlib.contextmanager
    def _weights_locked(self) -> Iterator[int]:
        """Hold every runner's weights lock (target first); yields the combined weights epoch."""
        locks = [self._target.weights_lock]
        if self._draft is not None and self._draft.weights_lock is not self._target.weights_lock:
            locks.append(self._draft.weights_lock)
        with contextlib.ExitStack() as stack:
            for lock in locks:
                while not lock.acquire(timeout=_LOCK_POLL_S):
                    if self._stopping:
                        raise RuntimeError("the scheduler is shutting down")
                stack.callback(lock.release)
            yield self._target.weights_epoch + (0 if self._draft is None else self._draft.weights_epoch)

    def _step(self, batch: Sequence[_Sequence]) -> list[_StepResult]:
        with self._weights_locked() as epoch, torch.inference_mode():
            for seq in batch:
                if seq.hidden_epoch != epoch:
                    seq.target_hidden = None
            proposals = [[] for _ in batch]
            if self._proposer is not None:
                # One token of the budget is always the target's own; proposing past it is wasted work.
                inputs = [
                    DraftInput(token_ids=s.token_ids, max_tokens=s.remaining - 1, target_hidden=s.target_hidden)
                    for s in batch
                ]
                proposals = self._proposer.propose(inputs)
            rows = [s.token_ids + p for s, p in zip(batch, proposals)]
            lora_rows = [s.request.lora_path for s in batch]
            if self._adapters is not None and any(name is not None for name in lora_rows):
                out = self._adapters.forward(self._target.model, pad_right(rows), lora_rows)
            else:
                out = self._target.model(pad_right(rows))
            keep_hidden = self._proposer is not None and self._proposer.needs_target_hidden
            results = []
            for b, (seq, proposal) in enumerate(zip(batch, proposals)):
                start = len(seq.token_ids) - 1  # logits here predict the first new token

                logprobs: list[float] = []

                def choose(
                    j: int, b: int = b, start: int = start, seq: _Sequence = seq, logprobs: list[float] = logprobs
                ) -> int:
                    logits = out.logits[b, start + j]
                    token = choose_token(logits, params=seq.params, generator=seq.generator)
                    if seq.request.return_logprob:
                        logprobs.append(token_logprob(logits, token, params=seq.params))
                    return token

                emitted, num_accepted = accept_tokens(proposal, choose)
                # Hidden states of every position whose token is now final except the last one emitted.
                hidden = out.hidden[b, : start + 1 + num_accepted].clone() if keep_hidden else None
                results.append(
                    _StepResult(
                        emitted=emitted,
                        logprobs=logprobs,
                        num_proposed=len(proposal),
                        num_accepted=num_accepted,
                        target_hidden=hidden,
                    )
                )
                seq.hidden_epoch = epoch
        return results

    def _apply(self, seq: _Sequence, result: _StepResult, version: str) -> None:
        kept = result.emitted[: max(seq.remaining, 0)]
        for i, token in enumerate(kept):
            if token in self._eos_ids:
                kept = kept[: i + 1]
                break
        seq.output_ids.extend(kept)
        seq.output_logprobs.extend(result.logprobs[: len(kept)])
        seq.num_verify += 1
        seq.num_proposed += result.num_proposed
        seq.num_accepted += min(result.num_accepted, len(kept))
        seq.target_hidden = result.target_hidden
        if kept:
            end = len(seq.output_ids)
            last = seq.version_spans[-1] if seq.version_spans else None
            if last is not None and last.version == version:
                seq.version_spans[-1] = dataclasses.replace(last, end=end)
            else:
                start = 0 if last is None else last.end
                seq.version_spans.append(WeightVersionSpan(version=version, start=start, end=end))

    def _is_finished(self, seq: _Sequence) -> bool:
        return seq.remaining <= 0 or bool(seq.output_ids and seq.output_ids[-1] in self._eos_ids)

    # ---- completion ---------------------------------------------------------------------------------------------

    def _complete_locked(self, seqs: Sequence[_Sequence]) -> list[tuple[_Sequence, GenerateResponse]]:
        done = []
        for seq in seqs:
            if seq.output_ids and seq.output_ids[-1] in self._eos_ids:
                reason = FinishReason(type=FinishReasonKind.STOP, matched=seq.output_ids[-1])
            else:
                reason = FinishReason(type=FinishReasonKind.LENGTH, length=len(seq.output_ids))
            done.append((seq, self._response(seq, reason)))
            if self._proposer is not None and seq.num_verify:
                self._spec_window.append((len(seq.output_ids), seq.num_verify))
        finished = set(map(id, seqs))
        self._running = [s for s in self._running if id(s) not in finished]
        return done

    def _abort_locked(self, message: str) -> list[tuple[_Sequence, GenerateResponse]]:
        seqs = [*self._running, *self._waiting]
        self._running.clear()
        self._waiting.clear()
        reason = FinishReason(type=FinishReasonKind.ABORT, message=message)
        return [(seq, self._response(seq, reason)) for seq in seqs]

    def _response(self, seq: _Sequence, reason: FinishReason) -> GenerateResponse:
        spec = self._proposer is not None
        completion = len(seq.output_ids)
        # SGLang answers one span of the current version for a request that produced no token yet, and names the
        # version of the last span as the response's weight_version.
        spans = tuple(seq.version_spans) or (WeightVersionSpan(version=self._weight_version, start=0, end=0),)
        meta = GenerateMetaInfo(
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=completion,
            weight_version=spans[-1].version,
            finish_reason=reason,
            spec_verify_ct=seq.num_verify if spec else None,
            spec_accept_rate=(seq.num_accepted / seq.num_proposed if seq.num_proposed else 0.0) if spec else None,
            # Tokens kept per verify step, bonus included; 1.0 when no draft token was ever accepted.
            spec_accept_length=(completion / seq.num_verify if seq.num_verify else 1.0) if spec else None,
            weight_versions=spans,
            **self._logprob_fields(seq),
        )
        text = "" if self._tokenizer is None else self._tokenizer.decode(seq.output_ids)
        return GenerateResponse(output_ids=tuple(seq.output_ids), meta_info=meta, text=text)

    def _logprob_fields(self, seq: _Sequence) -> dict:
        """meta_info's logprob keys: none without return_logprob, else SGLang's three
        (srt/managers/tokenizer_manager.py:2868-2870), the prompt's list empty (logprob_start_len -1 starts at the
        prompt's end: srt/managers/scheduler.py:3260-3264)."""
        if not seq.request.return_logprob:
            return {}
        assert len(seq.output_logprobs) == len(seq.output_ids), "one logprob per output token"
        # Each token decoded alone, as SGLang's batch_decode([[id], ...]) (srt/managers/tokenizer_manager.py:
        # 3110-3116); None without a tokenizer, as SGLang with skip_tokenizer_init.
        with_text = seq.request.return_text_in_logprobs and self._tokenizer is not None
        triples = tuple(
            (logprob, token, self._tokenizer.decode([token]) if with_text else None)
            for logprob, token in zip(seq.output_logprobs, seq.output_ids)
        )
        return {
            "input_token_logprobs": (),
            "output_token_logprobs": triples,
            "output_token_logprobs_length": len(triples),
        }

    @staticmethod
    def _resolve(finished: Sequence[tuple[_Sequence, GenerateResponse]]) -> None:
        # Outside `_cond`: a Future's callbacks (an event loop's wakeup) must not run under our lock.
        for seq, response in finished:
            if not seq.future.done():
                seq.future.set_result(response)
