"""Run the reference engine as a real subprocess for tests: `serve` on port 0, wait for health, kill in finally.

    with reference_server(model=ckpt / "target", draft_kind="mtp", log_dir=tmp_path) as server:
        status, body = server.post("/begin_weight_update", {"selector": "target"})

`post`/`get` speak plain HTTP on loopback with a timeout and return (status, body): the parsed JSON when the
answer is JSON, else the text, so tests see exactly what a client would.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_sync.env import ENGINE_ADMIN_API_KEY_VARIABLE

if TYPE_CHECKING:
    from miles_sync.transport.group import UpdateGroup

_LISTENING = "listening on "


class ServerProcess:
    """A running `serve` subprocess and a minimal JSON client for it."""

    def __init__(
        self,
        *,
        url: str,
        process: subprocess.Popen,
        log_path: Path,
        api_key: str | None,
        admin_api_key: str | None = None,
    ) -> None:
        self.url = url
        self.process = process
        self.log_path = log_path
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    def with_keys(self, *, api_key: str | None, admin_api_key: str | None = None) -> ServerProcess:
        """The same server, called with other keys."""
        return ServerProcess(
            url=self.url, process=self.process, log_path=self.log_path, api_key=api_key, admin_api_key=admin_api_key
        )

    def post(
        self, path: str, body: Any = None, *, timeout_s: float = 60.0, auth: bool = True, raw: bytes | None = None
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        return self._call("POST", path, data, timeout_s=timeout_s, auth=auth)

    def get(self, path: str, *, timeout_s: float = 60.0, auth: bool = True) -> tuple[int, Any]:
        return self._call("GET", path, None, timeout_s=timeout_s, auth=auth)

    def ok(self, path: str, body: Any = None, *, timeout_s: float = 60.0) -> Any:
        """POST and require a 2xx answer; the assertion message carries the server's answer."""
        status, answer = self.post(path, body, timeout_s=timeout_s)
        assert 200 <= status < 300, f"{path} -> {status}: {answer}"
        return answer

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def _call(self, method: str, path: str, data: bytes | None, *, timeout_s: float, auth: bool) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        # The key each route takes, as SGLang decides it: admin routes take the admin key when there is one.
        key = self.admin_api_key if self.admin_api_key is not None and _is_admin(method, path) else self.api_key
        if auth and key is not None:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, _parse(response.read(), response.headers.get_content_type())
        except urllib.error.HTTPError as error:
            return error.code, _parse(error.read(), error.headers.get_content_type())


def _is_admin(method: str, path: str) -> bool:
    from miles_sync.engine.reference.server import ADMIN_PATHS

    route = path.split("?", 1)[0]
    get_routes = {"/flush_cache"}  # the only admin route also served on GET
    return route in ADMIN_PATHS and (method == "POST" or route in get_routes)


def _parse(raw: bytes, content_type: str) -> Any:
    text = raw.decode(errors="replace")
    if content_type == "application/json":
        return json.loads(text)
    return text


@contextlib.contextmanager
def reference_server(
    *,
    model: Path,
    log_dir: Path,
    draft_kind: str = "none",
    draft: Path | None = None,
    weight_layout: str = "none",
    finalize_policy: str = "strict",
    spec_steps: int = 3,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    checksum_names: str | None = None,
    draft_role: str | None = None,
    host: str | None = "127.0.0.1",
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 120.0,
) -> Iterator[ServerProcess]:
    """Start `serve` (one torch thread, loopback, OS-chosen port); yield once /health answers; always kill it.
    `host=None` passes no --host, so serve picks its own default. The API key goes on the command line, the admin
    key through its environment variable (as EngineLauncher passes both); None options are not passed."""
    args = [
        sys.executable,
        "-m",
        "miles_sync.engine.reference.serve",
        "--model",
        str(model),
        "--draft-kind",
        draft_kind,
        "--weight-layout",
        weight_layout,
        "--finalize-policy",
        finalize_policy,
        "--spec-steps",
        str(spec_steps),
        "--port",
        "0",
        "--threads",
        "1",
        *extra_args,
    ]
    if host is not None:
        args += ["--host", host]
    if draft is not None:
        args += ["--draft", str(draft)]
    if api_key is not None:
        args += ["--api-key", api_key]
    if checksum_names is not None:
        args += ["--checksum-names", checksum_names]
    if draft_role is not None:
        args += ["--draft-role", draft_role]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"serve-{draft_kind}-{finalize_policy}-{time.monotonic_ns()}.log"
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **({} if env is None else env)}
    child_env.pop(ENGINE_ADMIN_API_KEY_VARIABLE, None)
    if admin_api_key is not None:
        child_env[ENGINE_ADMIN_API_KEY_VARIABLE] = admin_api_key
    with open(log_path, "w") as log:
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=child_env)
    try:
        url = _read_url(process, timeout_s=startup_timeout_s, log_path=log_path)
        server = ServerProcess(
            url=url, process=process, log_path=log_path, api_key=api_key, admin_api_key=admin_api_key
        )
        _wait_healthy(server, timeout_s=startup_timeout_s)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
        if process.stdout is not None:
            process.stdout.close()


def _read_url(process: subprocess.Popen, *, timeout_s: float, log_path: Path) -> str:
    found: list[str] = []

    def read() -> None:
        for line in process.stdout:
            if line.startswith(_LISTENING):
                found.append(line[len(_LISTENING) :].strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"serve did not report its port within {timeout_s} s (exit {process.poll()}):\n{tail}")
    return found[0]


def _wait_healthy(server: ServerProcess, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, _ = server.get("/health", timeout_s=5.0)
            if status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline or server.process.poll() is not None:
            raise RuntimeError(f"serve at {server.url} is not healthy:\n{server.log_tail()}")
        time.sleep(0.05)


# ---- helpers the reference-engine tests share ------------------------------------------------------------------


def checkpoint_tensors(checkpoint: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint directory, as a trainer holding the same model would have them."""
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def mtp_names(checkpoint: Path) -> set[str]:
    """Names of the MTP layer stored in a target checkpoint (index num_hidden_layers)."""
    config = json.loads((checkpoint / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    return {name for name in checkpoint_tensors(checkpoint) if name.startswith(prefix)}


def checksums(server: ServerProcess, selector: str = "all") -> dict[str, str]:
    answer = server.ok("/weights_checker", {"action": "checksum", "selector": selector})
    (rank,) = answer["ranks"]
    return rank["checksums"]


@contextlib.contextmanager
def tp_fleet(
    *, model: Path, log_dir: Path, tp_sizes: Sequence[int], extra_args: Sequence[str] = (), **options: Any
) -> Iterator[list[ServerProcess]]:
    """One `reference_server` per TP size of `tp_sizes`, in that order (each `--tp-size`, a 15 s collective
    timeout, then `extra_args`; `options` go to every server); all stopped on exit."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                reference_server(
                    model=model,
                    log_dir=log_dir,
                    extra_args=["--tp-size", str(tp), "--collective-timeout-s", "15", *extra_args],
                    **options,
                )
            )
            for tp in tp_sizes
        ]


def generate(
    server: ServerProcess, input_ids: Sequence[int], *, max_new_tokens: int = 4, timeout_s: float = 120.0
) -> tuple[int, Any]:
    body = {"input_ids": list(input_ids), "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    return server.post("/generate", body, timeout_s=timeout_s)


@contextlib.contextmanager
def joined_group(server: ServerProcess, *, group_name: str, timeout_s: float) -> Iterator[UpdateGroup]:
    """A gloo update group of two: this process is rank 0 (the source), the server rank 1. Destroyed on exit."""
    from miles_sync.transport.group import create_update_group, start_store_server

    store = start_store_server(host="127.0.0.1", timeout_s=timeout_s)
    join: list = []
    body = {
        "master_address": "127.0.0.1",
        "master_port": store.port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": group_name,
        "backend": "gloo",
    }
    joiner = threading.Thread(target=lambda: join.append(server.post("/init_weights_update_group", body)))
    joiner.start()
    group = create_update_group(
        master_address="127.0.0.1",
        master_port=store.port,
        rank=0,
        world_size=2,
        group_name=group_name,
        backend="gloo",
        timeout_s=timeout_s,
        store=store,
    )
    try:
        joiner.join(timeout_s)
        assert join and join[0][0] == 200, join
        yield group
    finally:
        group.destroy()
