"""The SGLang command runs as a real process: its entry point hands SGLang the keys inside the process.

SGLang itself cannot start here (no GPU build), so the process imports a stand-in `sglang.launch_server` from a
temporary directory: it records what SGLang's `prepare_server_args(sys.argv[1:])` would read, the process's
kernel command line (/proc/self/cmdline, what `ps` shows every local user) and the key variables left in its
environment (what SGLang's worker processes would inherit). The recorded arguments are then parsed with the
flags SGLang 0.5.23 defines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sglang_flags import parse_server_args, vendored_server_flags

from miles_sync.engine.sglang import SGLangEngineSpec
from miles_sync.env import ENGINE_ADMIN_API_KEY_VARIABLE, ENGINE_API_KEY_VARIABLE

API_KEY = "rollout-key-0123"
ADMIN_KEY = "admin-key-4567"
RUN_TIMEOUT_S = 60

STAND_IN = """
import json, os, sys

if __name__ == "__main__":  # as in sglang/launch_server.py: only a run as the main module reads its arguments
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().decode().split("\\0")
    record = {
        "args": sys.argv[1:],
        "cmdline": cmdline,
        "key_variables": sorted(k for k in os.environ if k.startswith("MILES_SYNC_ENGINE_")),
    }
    with open(os.environ["STAND_IN_RECORD"], "w") as f:
        json.dump(record, f)
"""


def test_the_keys_reach_sglang_but_not_its_command_line_or_workers(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(STAND_IN)
    spec = SGLangEngineSpec(model_path="/ckpt/target", tp_size=2, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    command = spec.command(host="127.0.0.1")
    record_path = tmp_path / "record.json"
    env = {
        **os.environ,
        **command.env,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "STAND_IN_RECORD": str(record_path),
    }
    done = subprocess.run(command.argv, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    record = json.loads(record_path.read_text())

    assert record["cmdline"][: len(command.argv)] == list(command.argv) and record["cmdline"][0] == sys.executable
    assert not any(API_KEY in a or ADMIN_KEY in a for a in record["cmdline"])
    assert record["key_variables"] == []
    parsed = parse_server_args(vendored_server_flags(), record["args"])
    assert parsed["api_key"] == API_KEY and parsed["admin_api_key"] == ADMIN_KEY
    assert parsed["model_path"] == "/ckpt/target" and parsed["tp_size"] == 2
    assert {ENGINE_API_KEY_VARIABLE, ENGINE_ADMIN_API_KEY_VARIABLE} == set(command.env)
