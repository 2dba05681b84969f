"""The vendored SGLang logprob field names (tests/data/sglang_logprob_fields.json): still SGLang's, and what our
`/generate` records carry.

Where SGLang 0.5.23's source has them: `GenerateReqInput` in sglang/srt/managers/io_struct.py declares the request
fields (all but `return_text_in_logprobs` default to None there) and its single-request normalization sets
`if self.<field> is None: self.<field> = <default>`; `TokenizerManager.add_logprob_to_meta_info` in
sglang/srt/managers/tokenizer_manager.py sets the meta_info keys unconditionally at its top level. The source is
read with `ast` from the package the test command installs into .venv-sglang (the `sglang_source` fixture; never
imported).
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

from sglang_source import source_reader

from miles_sync.wire.protocol import GenerateMetaInfo, GenerateRequest, encode

VENDORED = json.loads((Path(__file__).parents[1] / "data" / "sglang_logprob_fields.json").read_text())
IO_STRUCT = "sglang/srt/managers/io_struct.py"
TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"


def test_generate_request_carries_sglangs_logprob_fields_and_defaults() -> None:
    body = encode(GenerateRequest(input_ids=(1,)))
    assert {name: body[name] for name in VENDORED["generate_req_input"]} == VENDORED["generate_req_input"]


def test_meta_info_carries_sglangs_logprob_keys() -> None:
    names = {f.name for f in dataclasses.fields(GenerateMetaInfo)}
    assert set(VENDORED["meta_info_logprob_keys"]) <= names


def _is_self_attr(node: ast.AST, name: str | None = None) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and (name is None or node.attr == name)
    )


def _request_defaults(module: ast.Module) -> dict[str, object]:
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    declared = {
        item.target.id: ast.literal_eval(item.value)
        for item in cls.body
        if isinstance(item, ast.AnnAssign)
        and isinstance(item.target, ast.Name)
        and isinstance(item.value, ast.Constant)
    }
    normalized = {}
    for node in ast.walk(cls):
        # if self.X is None: self.X = <constant>
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and _is_self_attr(node.test.left)):
            continue
        is_none = isinstance(node.test.ops[0], ast.Is) and ast.literal_eval(node.test.comparators[0]) is None
        name = node.test.left.attr
        for statement in node.body:
            if (
                is_none
                and isinstance(statement, ast.Assign)
                and _is_self_attr(statement.targets[0], name)
                and isinstance(statement.value, ast.Constant | ast.UnaryOp)
            ):
                normalized.setdefault(name, ast.literal_eval(statement.value))
    return {**declared, **normalized}


def _meta_info_keys(module: ast.Module) -> list[str]:
    handler = next(
        n for n in ast.walk(module) if isinstance(n, ast.FunctionDef) and n.name == "add_logprob_to_meta_info"
    )
    return [
        statement.targets[0].slice.value
        for statement in handler.body
        if isinstance(statement, ast.Assign)
        and isinstance(statement.targets[0], ast.Subscript)
        and isinstance(statement.targets[0].value, ast.Name)
        and statement.targets[0].value.id == "meta_info"
    ]


def test_vendored_fields_are_sglangs(sglang_source) -> None:
    read = source_reader(sglang_source(VENDORED["sglang_version"]))
    defaults = _request_defaults(ast.parse(read(IO_STRUCT)))
    assert {name: defaults[name] for name in VENDORED["generate_req_input"]} == VENDORED["generate_req_input"]
    assert _meta_info_keys(ast.parse(read(TOKENIZER_MANAGER))) == VENDORED["meta_info_logprob_keys"]
