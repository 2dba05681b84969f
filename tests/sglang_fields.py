"""SGLang's `/weights_checker` answer shape, read from SGLang's released source with `ast` (never imported).

    fields = derive_checker_fields(installed_sglang("0.5.23"))   # or a wheel (tests/sglang_source.py)
    vendored_checker_fields() == fields

The vendored copy (tests/data/sglang_checker_fields.json) is what tests compare answers against; this module
re-derives it from SGLang's source so a test can show the copy is still SGLang's. Where SGLang's source has the fields:

- the JSON body keys: `check_weights` in sglang/srt/entrypoints/http_server.py builds a dict with the keys it
  always sends, then sets the others only when they are not None;
- `CheckWeightsReqOutput`, `ChecksumInfo` and `ParallelismInfo` in sglang/srt/managers/io_struct.py (the msgspec
  records the scheduler sends; each `ChecksumInfo` becomes one entry of the body's `ranks`);
- `ChecksumInfo` and `ParallelismInfo` again in sglang/srt/utils/weight_checker.py (the pydantic models the
  checker builds): their field names must agree with io_struct's, else derivation raises.
"""

from __future__ import annotations

import ast
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from sglang_source import source_reader

__all__ = [
    "CheckerFields",
    "LoraFields",
    "VENDORED_PATH",
    "derive_checker_fields",
    "derive_lora_fields",
    "vendored_checker_fields",
    "vendored_lora_fields",
]

VENDORED_PATH = Path(__file__).parent / "data" / "sglang_checker_fields.json"

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
WEIGHT_CHECKER = "sglang/srt/utils/weight_checker.py"
VERSION = "sglang/_version.py"
HANDLER = "check_weights"


@dataclass(frozen=True, kw_only=True)
class CheckerFields:
    """Field names in SGLang's declaration order. `body_keys` = `body_always` + `body_optional`: the keys a
    `/weights_checker` answer can carry; the optional ones are omitted when None (`ranks`, for an action other
    than checksum). `check_weights_req_output`: that class's own fields, without the IPC bookkeeping it inherits
    from `BaseReq` (`rid`, `http_worker_ipc`), which never reaches the body."""

    sglang_version: str
    body_always: tuple[str, ...]
    body_optional: tuple[str, ...]
    check_weights_req_output: tuple[str, ...]
    checksum_info: tuple[str, ...]
    parallelism_info: tuple[str, ...]

    @property
    def body_keys(self) -> tuple[str, ...]:
        return self.body_always + self.body_optional

    def to_json(self) -> str:
        return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> CheckerFields:
        raw = json.loads(text)
        return cls(**{k: v if isinstance(v, str) else tuple(v) for k, v in raw.items()})


def vendored_checker_fields() -> CheckerFields:
    """The copy under tests/data, derived from the SGLang version it names."""
    return CheckerFields.from_json(VENDORED_PATH.read_text())


def derive_checker_fields(source: Path) -> CheckerFields:
    """Parse the fields out of SGLang's source: a wheel, or a directory holding the unpacked `sglang/` package.
    Raises ValueError naming the file and definition that is missing or inconsistent."""
    read = source_reader(source)
    always, optional = _body_keys(ast.parse(read(HTTP_SERVER)))
    io_struct = ast.parse(read(IO_STRUCT))
    checker = ast.parse(read(WEIGHT_CHECKER))
    records = {}
    for name in ("ChecksumInfo", "ParallelismInfo"):
        wire, model = _class_fields(io_struct, name, IO_STRUCT), _class_fields(checker, name, WEIGHT_CHECKER)
        if wire != model:
            raise ValueError(f"{name}: {IO_STRUCT} has {list(wire)}, {WEIGHT_CHECKER} has {list(model)}")
        records[name] = wire
    return CheckerFields(
        sglang_version=_version(ast.parse(read(VERSION))),
        body_always=always,
        body_optional=optional,
        check_weights_req_output=_class_fields(io_struct, "CheckWeightsReqOutput", IO_STRUCT),
        checksum_info=records["ChecksumInfo"],
        parallelism_info=records["ParallelismInfo"],
    )


def _class_fields(module: ast.Module, name: str, path: str) -> tuple[str, ...]:
    """The annotated attributes of class `name`, in order (ClassVar-free: these classes declare none)."""
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return tuple(
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            )
    raise ValueError(f"{path} defines no class {name}")


def _body_keys(module: ast.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(keys of the dict the handler returns, keys it adds afterwards). The returned dict is the first argument of
    the handler's `return SomeResponse(body, ...)`."""
    handler = next(
        (n for n in module.body if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef) and n.name == HANDLER),
        None,
    )
    if handler is None:
        raise ValueError(f"{HTTP_SERVER} defines no handler {HANDLER}")
    returned = [
        n.value.args[0].id
        for n in ast.walk(handler)
        if isinstance(n, ast.Return)
        and isinstance(n.value, ast.Call)
        and n.value.args
        and isinstance(n.value.args[0], ast.Name)
    ]
    if len(set(returned)) != 1:
        raise ValueError(f"{HTTP_SERVER}:{HANDLER} does not return one named body: {returned}")
    body = returned[0]
    always: list[str] = []
    optional: list[str] = []
    for node in ast.walk(handler):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name) and target.id == body and isinstance(node.value, ast.Dict):
                always += [_constant(key) for key in node.value.keys]
            elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == body:
                optional.append(_constant(target.slice))
    if not always:
        raise ValueError(f"{HTTP_SERVER}:{HANDLER} builds {body!r} from no dict literal")
    return tuple(always), tuple(optional)


def _constant(node: ast.AST | None) -> str:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        raise ValueError(f"{HTTP_SERVER}:{HANDLER}: body key {ast.dump(node) if node else '**'} is not a string")
    return node.value


def _version(module: ast.Module) -> str:
    for node in module.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return _constant_version(node.value)
    raise ValueError(f"{VERSION} assigns no __version__")


def _constant_version(node: ast.AST) -> str:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        raise ValueError(f"{VERSION}: __version__ is not a string literal")
    return node.value


# ---- LoRA adapter endpoints ------------------------------------------------------------------------------------

LORA_VENDORED_PATH = Path(__file__).parent / "data" / "sglang_lora_fields.json"
LORA_ROUTES = {
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}


@dataclass(frozen=True, kw_only=True)
class LoraFields:
    """SGLang's adapter records, fields in declaration order (without `BaseReq`'s IPC bookkeeping `rid` and
    `http_worker_ipc`, which these classes inherit and never declare). `routes`: path -> the request class its
    handler takes; both answer `LoRAUpdateOutput`. `generate_lora_field`: whether `GenerateReqInput` declares
    `lora_path`, the field that selects an adapter."""

    sglang_version: str
    routes: dict[str, str]
    load_from_tensors: tuple[str, ...]
    unload: tuple[str, ...]
    update_output: tuple[str, ...]
    generate_has_lora_path: bool

    def to_json(self) -> str:
        return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> LoraFields:
        raw = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def vendored_lora_fields() -> LoraFields:
    return LoraFields.from_json(LORA_VENDORED_PATH.read_text())


def derive_lora_fields(source: Path) -> LoraFields:
    """The adapter records out of SGLang's source (a wheel or an unpacked directory); ValueError naming what is
    missing."""
    read = source_reader(source)
    io_struct = ast.parse(read(IO_STRUCT))
    server = ast.parse(read(HTTP_SERVER))
    routes = {}
    for path, record in LORA_ROUTES.items():
        handler = _route_handler(server, path)
        annotations = [ast.unparse(arg.annotation) for arg in handler.args.args if arg.annotation is not None]
        if not any(record in a for a in annotations):
            raise ValueError(f"{HTTP_SERVER}: the handler of {path} takes none of {record} ({annotations})")
        routes[path] = record
    return LoraFields(
        sglang_version=_version(ast.parse(read(VERSION))),
        routes=routes,
        load_from_tensors=_class_fields(io_struct, "LoadLoRAAdapterFromTensorsReqInput", IO_STRUCT),
        unload=_class_fields(io_struct, "UnloadLoRAAdapterReqInput", IO_STRUCT),
        update_output=_class_fields(io_struct, "LoRAUpdateOutput", IO_STRUCT),
        generate_has_lora_path="lora_path" in _class_fields(io_struct, "GenerateReqInput", IO_STRUCT),
    )


def _route_handler(module: ast.Module, path: str) -> ast.AsyncFunctionDef | ast.FunctionDef:
    """The function decorated with `@app.api_route(path, ...)` (or `@app.post(path)`)."""
    for node in module.body:
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if (
                isinstance(decorator, ast.Call)
                and decorator.args
                and isinstance(decorator.args[0], ast.Constant)
                and decorator.args[0].value == path
            ):
                return node
    raise ValueError(f"{HTTP_SERVER} routes no handler at {path}")
