"""The rollout side of one engine: `RolloutWorker` (lifecycle plus generation) and `Sample`, every sample tagged
with the weight version the engine reported for it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from miles_sync.engine.client import EngineClient
from miles_sync.engine.kinds import EngineSpec
from miles_sync.engine.process import EngineLauncher
from miles_sync.env import LOOPBACK_HOST
from miles_sync.wire.api import EngineError
from miles_sync.wire.protocol import GenerateRequest, GenerateResponse, SamplingParams, WeightVersionSpan

__all__ = ["RolloutWorker", "Sample", "generate_samples"]


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One generated completion, stamped with the weight version the engine reported for it."""

    engine_url: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    weight_version: str
    spec_accept_length: float | None = None  # mean tokens accepted per verify step; None without a draft
    # The engine's logprob of each output token (SGLang's meta_info.output_token_logprobs, the logprob of each
    # triple): log_softmax of the target's temperature-scaled logits, before top-p. None unless requested.
    output_logprobs: tuple[float, ...] | None = None
    # The versions that produced the output tokens, as SGLang's meta_info.weight_versions spans (oldest first);
    # more than one when a sync changed the weights while the request ran (retract, in_place).
    weight_versions: tuple[WeightVersionSpan, ...] = ()

    def token_versions(self) -> tuple[str, ...]:
        """The version of each output token: the spans', or `weight_version` for all where the engine sent none."""
        if not self.weight_versions:
            return (self.weight_version,) * len(self.output_ids)
        versions = tuple(s.version for s in self.weight_versions for _ in range(s.start, s.end))
        if len(versions) != len(self.output_ids):
            raise EngineError(
                url=self.engine_url,
                endpoint="/generate",
                status=200,
                message=f"weight_versions spans cover {len(versions)} tokens, the output has {len(self.output_ids)}",
            )
        return versions


async def generate_samples(
    client: EngineClient,
    prompts: Sequence[Sequence[int]],
    *,
    sampling: SamplingParams,
    return_logprob: bool = False,
    lora_path: str | None = None,
) -> tuple[Sample, ...]:
    """One completion per prompt from the engine behind `client`, requested concurrently (the engine batches
    them); each Sample carries the weight version the engine reported for it, and with `return_logprob` the
    logprob of every output token. Raises EngineError when the engine answers logprobs that do not cover every
    output token once."""
    responses = await asyncio.gather(
        *(
            client.generate(
                GenerateRequest(
                    input_ids=tuple(p), sampling_params=sampling, return_logprob=return_logprob, lora_path=lora_path
                )
            )
            for p in prompts
        )
    )
    return tuple(
        Sample(
            engine_url=client.url,
            prompt_ids=tuple(prompt),
            output_ids=tuple(r.output_ids),
            weight_version=r.meta_info.weight_version,
            spec_accept_length=r.meta_info.spec_accept_length,
            output_logprobs=_output_logprobs(r, url=client.url) if return_logprob else None,
            weight_versions=r.meta_info.weight_versions,
        )
        for prompt, r in zip(prompts, responses)
    )


def _output_logprobs(response: GenerateResponse, *, url: str) -> tuple[float, ...]:
    """The logprob of each output token, checked against the output ids (an engine that answered none, or
    triples for other tokens, would silently misalign a trainer's ratios)."""
    triples = response.meta_info.output_token_logprobs
    if triples is None:
        raise EngineError(
            url=url,
            endpoint="/generate",
            status=200,
            message="asked for return_logprob, meta_info has no output_token_logprobs",
        )
    ids = tuple(token for _, token, _ in triples)
    values = tuple(logprob for logprob, _, _ in triples)
    if ids != response.output_ids or any(v is None for v in values):
        raise EngineError(
            url=url,
            endpoint="/generate",
            status=200,
            message=f"output_token_logprobs ({len(triples)} triples) do not match the {len(response.output_ids)} "
            "output ids one to one",
        )
    return values


class RolloutWorker:
    """One rollout engine: launches its server and generates from it. Async, bound to the event loop it first runs
    on (a Ray async actor wraps it). `start` must come first; `restart` gives a new URL."""

    def __init__(
        self,
        *,
        spec: EngineSpec,
        log_dir: str | os.PathLike,
        host: str = LOOPBACK_HOST,
        http_timeout_s: float = 60.0,
        startup_timeout_s: float = 180.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not http_timeout_s > 0:
            raise ValueError(f"invalid RolloutWorker: http_timeout_s={http_timeout_s} must be positive")
        self._launcher = EngineLauncher(
            spec=spec, log_dir=log_dir, host=host, startup_timeout_s=startup_timeout_s, env=env
        )
        self._http_timeout_s = http_timeout_s
        self._client: EngineClient | None = None
        self._api_key = spec.api_key

    async def start(self) -> str:
        return await asyncio.to_thread(self._launcher.start)

    async def stop(self) -> None:
        await self._close_client()
        await asyncio.to_thread(self._launcher.stop)

    async def kill(self) -> None:
        """Crash the server (SIGKILL), e.g. to exercise a sync that loses an engine mid-broadcast."""
        await self._close_client()
        await asyncio.to_thread(self._launcher.kill)

    async def restart(self) -> str:
        await self._close_client()
        return await asyncio.to_thread(self._launcher.restart)

    def url(self) -> str | None:
        return self._launcher.url

    def pid(self) -> int | None:
        return self._launcher.pid

    def is_running(self) -> bool:
        return self._launcher.is_running

    def log_tail(self) -> str:
        return self._launcher.log_tail()

    async def generate(
        self, prompts: Sequence[Sequence[int]], *, sampling: SamplingParams, return_logprob: bool = False
    ) -> tuple[Sample, ...]:
        """Generate one completion per prompt, concurrently (the engine batches them); `generate_samples`. Raises
        EngineError when the engine refuses (e.g. stale after a failed sync) or does not answer within the HTTP
        timeout."""
        url = self._launcher.url
        if url is None:
            raise RuntimeError("RolloutWorker.generate before start(): no engine is running")
        return await generate_samples(
            self._connected_client(url), prompts, sampling=sampling, return_logprob=return_logprob
        )

    def _connected_client(self, url: str) -> EngineClient:
        # One client per server start: a restarted engine has a new URL.
        if self._client is None or self._client.url != url.rstrip("/"):
            self._client = EngineClient(url, timeout_s=self._http_timeout_s, api_key=self._api_key)
        return self._client

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()
