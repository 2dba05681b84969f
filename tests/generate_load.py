"""Steady /generate traffic against engines while syncs run, and the checks every request's answer must pass.

    with GenerateLoad(urls, in_flight=2, request=LOAD_REQUEST) as load:
        load.wait_for_answers(per_url=2, timeout_s=120)     # the load is flowing on every engine
        ...syncs...
    figures = request_figures(load.answers, versions_by_url=...)

`in_flight` clients per URL each send one request after another (to loopback only) until the load stops or
`max_requests` per client; each runs on the load's own thread and event loop, so the syncs under test keep theirs.
Every answer's status, finish reason, SGLang `meta_info.weight_versions` spans and send/answer times are kept;
a failed request is recorded, never raised, and its client stops (a server that is gone fails every request at
once, and the client would otherwise retry in a tight loop). Used by the real-server load tier
(tests/sglang/test_sglang_load.py) and benchmarks/bench_load_sync.py.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["Answer", "GenerateLoad", "load_request", "request_figures", "version_problem"]


def load_request(max_new_tokens: int) -> dict[str, Any]:
    """A greedy request of `max_new_tokens` (SGLang's /generate body); ignore_eos keeps every answer full length."""
    return {
        "input_ids": list(range(5, 21)),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    }


@dataclass(frozen=True, kw_only=True)
class Answer:
    """One request's outcome: `status` None and `error` set when no HTTP answer came."""

    url: str
    sent_at: float  # time.monotonic()
    answered_at: float
    status: int | None
    finish: str | None  # SGLang's meta_info.finish_reason.type: "length", "stop", "abort"
    spans: tuple[tuple[str, int, int], ...]  # (version, start, end) per meta_info.weight_versions span
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.answered_at - self.sent_at

    @property
    def versions(self) -> list[str]:
        """The versions that produced at least one token, in the order the spans give."""
        return [v for v, start, end in self.spans if end > start]


class GenerateLoad:
    """`in_flight` clients per URL on a thread of its own (module docstring)."""

    def __init__(
        self,
        urls: Collection[str],
        *,
        in_flight: int,
        request: Mapping[str, Any],
        max_requests: int = 10_000,
        request_timeout_s: float = 300.0,
    ) -> None:
        self.urls = tuple(urls)
        self.in_flight, self.request, self.max_requests = in_flight, dict(request), max_requests
        self.request_timeout_s = request_timeout_s
        self.answers: list[Answer] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="generate-load", daemon=True)

    def __enter__(self) -> GenerateLoad:
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop(wait_s=5.0 if exc_type is not None else self.request_timeout_s + 10.0)

    def stop(self, *, wait_s: float) -> bool:
        """No new requests; waits up to `wait_s` for the ones in flight (a held engine keeps its requests waiting:
        after a failure do not wait them out). True if every client ended."""
        self._stop.set()
        self._thread.join(timeout=wait_s)
        return not self._thread.is_alive()

    def wait_for_answers(self, *, per_url: int, since: float = 0.0, timeout_s: float) -> None:
        """Until every URL has `per_url` answers sent after `since` (time.monotonic()); TimeoutError otherwise."""

        def flowing() -> bool:
            counts = {u: 0 for u in self.urls}
            for a in self.answers:
                if a.sent_at >= since:
                    counts[a.url] += 1
            return all(n >= per_url for n in counts.values())

        with self._changed:
            if not self._changed.wait_for(flowing, timeout=timeout_s):
                counts = {u: sum(a.url == u and a.sent_at >= since for a in self.answers) for u in self.urls}
                raise TimeoutError(f"the load did not answer {per_url} requests per engine in {timeout_s} s: {counts}")

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._client(session, u) for u in self.urls for _ in range(self.in_flight)))

    async def _client(self, session: aiohttp.ClientSession, url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        for _ in range(self.max_requests):
            if self._stop.is_set():
                return
            sent_at = time.monotonic()
            status, finish, spans, error = None, None, (), None
            try:
                async with session.post(url + "/generate", json=self.request, timeout=timeout) as response:
                    status = response.status
                    body = await response.json(content_type=None)
                meta = body.get("meta_info", {}) if isinstance(body, dict) else {}
                reason = meta.get("finish_reason") or {}
                finish = reason.get("type") if isinstance(reason, dict) else str(reason)
                spans = tuple(
                    (str(s["version"]), int(s["start"]), int(s["end"])) for s in meta.get("weight_versions", [])
                )
            except Exception as exc:  # a failed request is counted, never raised
                error = f"{type(exc).__name__}: {exc}"
            answer = Answer(
                url=url,
                sent_at=sent_at,
                answered_at=time.monotonic(),
                status=status,
                finish=finish,
                spans=spans,
                error=error,
            )
            with self._changed:
                self.answers.append(answer)
                self._changed.notify_all()
            if status != 200:
                return


def version_problem(answer: Answer, *, served: Collection[str], order: list[str]) -> str | None:
    """What is wrong with an answer's version spans, or None: every version that produced a token must be one the
    engine was verified to serve (`served`: its starting version and every version a sync verified on it) and the
    spans must follow `order` (the versions in the order the syncs ran)."""
    versions = answer.versions
    unknown = [v for v in versions if v not in served]
    if unknown:
        return f"tokens tagged with {unknown}, never verified on {answer.url} (verified: {sorted(served)})"
    positions = [order.index(v) for v in versions]
    if positions != sorted(positions):
        return f"spans out of sync order: {answer.spans}"
    return None


def request_figures(answers: list[Answer], *, served_by_url: Mapping[str, Collection[str]], order: list[str]) -> dict:
    """Counts, latencies and the version check of a load's answers (version_problem per answered request)."""
    answered = [a for a in answers if a.status == 200]
    latencies = sorted(a.latency_s for a in answered)
    problems = [p for a in answered if (p := version_problem(a, served=served_by_url[a.url], order=order))]
    return {
        "requests": len(answers),
        "answered": len(answered),
        "aborted": sum(a.finish == "abort" for a in answered),
        "failed": sum(a.status != 200 for a in answers),
        "failures": [a.error or a.status for a in answers if a.status != 200][:5],
        "spanning_versions": sum(len(set(a.versions)) > 1 for a in answered),
        "bad_versions": len(problems),
        "version_problems": problems[:5],
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_max_s": latencies[-1] if latencies else None,
    }
