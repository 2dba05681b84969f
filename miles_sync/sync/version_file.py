"""The committed version on disk (`SyncController(version_file=...)`): numbering continues after a controller
restart even when every engine restarted too and reports no version of its own."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_committed_version(path: str) -> int:
    """The version a `version_file` holds; 0 when there is none yet. Raises ValueError for a file that is not one
    (never silently restarts the numbering)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return 0
    try:
        version = int(json.loads(text)["committed_version"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"version file {path} does not hold a committed version: {text[:200]!r}") from exc
    if version < 0:
        raise ValueError(f"version file {path} holds a negative version {version}")
    return version


def write_committed_version(path: str, version: int) -> None:
    """Replace `path`'s content with `version` atomically (a crash leaves the old file or the new, never half)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps({"committed_version": version}) + "\n")
    os.replace(scratch, target)
