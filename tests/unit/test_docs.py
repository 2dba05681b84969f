"""The docs point at real things: every relative link in README.md and docs/*.md names a file of the repository (and,
with an anchor, a heading of that file), and every config key they write resolves in the typed config.

A failure names the page and the link or key: a moved section, a renamed file or a renamed config key then fails
here instead of sending a reader nowhere. Config keys are recognised by their first part, one of the config's
sections (`sync.pause_mode=retract`, `` `engines.kind` ``), in inline code and, as `section.key=value`, in command
lines; Python names (`miles_sync.sync.controller`), calls and HF tensor names (`model.norm.weight`) are not keys.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import typing
from pathlib import Path

from miles_sync.config import MilesSyncConfig

REPO = Path(__file__).resolve().parents[2]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))

_FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
# A dotted name's parts; a `{a,b}` part stands for each member (`trainer.{tp,pp}`, `sync.{http,sync}_timeout_s`).
_PART = r"(?:\{[\w,]+\}\w*|\w+)"
# Not a key although it starts with a section's name: HF tensor names and file names.
_NOT_KEY_ENDINGS = {"weight", "bias", "py", "md", "json", "yaml", "sh", "txt", "png"}


def _config_keys(cls: type, prefix: str = "") -> set[str]:
    """Every dotted key of a config dataclass tree, sections included (`sync`, `sync.lora`, `sync.lora.rank`)."""
    hints = typing.get_type_hints(cls)
    keys = set()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.add(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= _config_keys(hints[f.name], f"{key}.")
    return keys


CONFIG_KEYS = _config_keys(MilesSyncConfig)
SECTIONS = sorted({key.split(".")[0] for key in CONFIG_KEYS if "." in key})  # model, trainer, engines, sync, ...
_KEY = re.compile(rf"(?<![\w./\-{{])(?:{'|'.join(SECTIONS)})(?:\.{_PART})+")


def _without_code(text: str) -> str:
    """The text with fenced code blocks and inline code removed: links and headings live outside them."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lowercased, punctuation other than `-` and `_`
    dropped, spaces made `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets `-1`, `-2`, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_problems(page: Path) -> list[str]:
    """What is wrong with each relative link of `page`: a missing file, or an anchor no heading of it has."""
    problems = []
    for target in _LINK.findall(_without_code(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not this repository's
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        name = f"{page.relative_to(REPO)}: link ({target})"
        if not resolved.exists():
            problems.append(f"{name}: no file {path}")
        elif anchor and (resolved.is_dir() or resolved.suffix != ".md"):
            problems.append(f"{name}: #{anchor} on a page that is not markdown")
        elif anchor and anchor not in anchors(resolved):
            problems.append(f"{name}: {resolved.relative_to(REPO)} has no heading #{anchor}")
    return problems


def _expand(name: str) -> list[str]:
    """`trainer.{tp,pp}` -> `trainer.tp`, `trainer.pp`; a name without braces is itself."""
    parts = re.split(r"\{([\w,]+)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def named_keys(text: str) -> list[str]:
    """The config keys a page writes: dotted names starting with a section in inline code, and `section.key=` in
    code blocks (command lines). Calls, HF tensor names (a numeric part, or ending in weight/bias) and file names
    are skipped."""
    spans = [(m.group(1), False) for m in _INLINE_CODE.finditer(_FENCE.sub("", text))]
    spans += [(m.group(0), True) for m in _FENCE.finditer(text)]
    keys = []
    for span, is_block in spans:
        for match in _KEY.finditer(span):
            after = span[match.end() : match.end() + 1]
            if after == "(" or (is_block and after != "="):
                continue
            for key in _expand(match.group(0)):
                parts = key.split(".")
                if any(p.isdigit() for p in parts) or parts[-1] in _NOT_KEY_ENDINGS:
                    continue
                keys.append(key)
    return keys


def test_every_relative_link_names_a_file_and_a_heading_that_exist():
    problems = [problem for page in PAGES for problem in link_problems(page)]
    assert not problems, "\n".join(problems)


def test_every_config_key_the_docs_name_is_a_key_of_the_typed_config():
    problems = [
        f"{page.relative_to(REPO)}: `{key}` is not a key of miles_sync.config.MilesSyncConfig"
        for page in PAGES
        for key in dict.fromkeys(named_keys(page.read_text()))
        if key not in CONFIG_KEYS
    ]
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme():
    targets = _LINK.findall(_without_code((REPO / "README.md").read_text()))
    linked = {(REPO / target.partition("#")[0]).resolve() for target in targets}
    orphans = [str(page.relative_to(REPO)) for page in PAGES[1:] if page.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"


def test_the_checks_recognise_what_they_check():
    # The recognisers themselves, on the shapes the pages use: a check that matches nothing passes vacuously.
    assert slug("Set-up (two commands, fresh clone, CPU machine)") == "set-up-two-commands-fresh-clone-cpu-machine"
    assert slug("`rollout.overlap` and the router; engines") == "rolloutoverlap-and-the-router-engines"
    text = (
        "`sync.pause_mode=retract engines.kind=sglang` `trainer.{tp,pp}` `sync.{http,sync}_timeout_s` "
        "`miles_sync.sync.controller` `model.norm.weight` `model.layers.2.eh_proj.weight` `model.get_parameter(n)` "
        "`launch/sync.py` `sync.py`\n"
        "```bash\nbash launch/local.sh rollout.router=true\nreport = controller.sync()\n```\n"
    )
    assert named_keys(text) == [
        "sync.pause_mode",
        "engines.kind",
        "trainer.tp",
        "trainer.pp",
        "sync.http_timeout_s",
        "sync.sync_timeout_s",
        "rollout.router",
    ]
    assert {"sync", "sync.lora", "sync.lora.rank", "engines.kind", "num_rounds"} <= CONFIG_KEYS
