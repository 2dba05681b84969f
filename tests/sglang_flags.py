"""SGLang's server command-line flags, read from SGLang's released source with `ast` (never imported).

    flags = derive_server_flags(installed_sglang("0.5.23"))   # or a wheel (tests/sglang_source.py)
    vendored_server_flags() == flags
    parse_server_args(flags, ["--model-path", "m", "--tp-size", "2"]) == {"model_path": "m", "tp_size": 2}

The vendored copy (tests/data/sglang_server_flags.json) is what tests parse our command lines with; this module
re-derives it from SGLang's source so a test can show the copy is still SGLang's. SGLang 0.5.23 builds its parser
(`ServerArgs.add_cli_args` in sglang/srt/server_args.py) in two parts, read here the way it runs:

- `add_cli_args_from_dataclass` (sglang/srt/arg_groups/arg_utils.py) registers one option per field, declared
  `name: A[T, "help"]` or `name: A[T, Arg(...)]`, of every namespace class named in `_INPUT_NAMESPACES`
  (sglang/srt/arg_groups/fields/*.py); `Arg(no_cli=True)` and fields without that metadata get none. The option
  is `Arg.cli_name` or `--` + the field name with `-` for `_`, plus `Arg.aliases`. Its form follows T: an explicit
  `Arg.action` as given (`argparse.BooleanOptionalAction` adds `--no-<name>`); else, after unwrapping Optional,
  `Literal[...]` -> one value among them, `list[X]` -> `Arg.nargs` or "+" values, `bool` -> a switch, anything
  else one value (`Arg.type_parser` or int/float/str).
- the `parser.add_argument(...)` calls after it: the options whose choices are computed at parse time,
  `--config` and the deprecated spellings.
"""

from __future__ import annotations

import argparse
import ast
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sglang_source import source_reader

__all__ = [
    "SERVER_FLAGS_PATH",
    "ServerArgsError",
    "ServerFlag",
    "ServerFlags",
    "derive_server_flags",
    "parse_server_args",
    "server_parser",
    "vendored_server_flags",
]

SERVER_FLAGS_PATH = Path(__file__).parent / "data" / "sglang_server_flags.json"

SERVER_ARGS = "sglang/srt/server_args.py"
VERSION = "sglang/_version.py"
NAMESPACE_LIST = "_INPUT_NAMESPACES"
_SWITCH_ACTIONS = {"store_true", "store_false", "store_const", "count", "help", "version"}


@dataclass(frozen=True, kw_only=True)
class ServerFlag:
    """One option string of SGLang's server parser. `nargs` is argparse's (None: exactly one value) and means
    nothing for a switch. `choices` None: any value `value_type` parses; `dynamic_choices` names the expression
    when they are computed at parse time (plugins, environment) and so cannot be listed here."""

    dest: str
    takes_value: bool
    nargs: str | None = None
    value_type: str | None = None  # "str", "int", "float" or SGLang's own parser function; None for a switch
    choices: tuple[Any, ...] | None = None
    dynamic_choices: str | None = None
    is_required: bool = False


@dataclass(frozen=True, kw_only=True)
class ServerFlags:
    sglang_version: str
    flags: dict[str, ServerFlag]  # option string -> its flag, sorted by option

    def to_json(self) -> str:
        """One line per option, fields at their defaults left out (a diff then shows which flag changed)."""
        defaults = asdict(ServerFlag(dest="", takes_value=False))
        lines = []
        for option, flag in self.flags.items():
            fields = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(flag).items()}
            shown = {k: v for k, v in fields.items() if k in ("dest", "takes_value") or v != defaults[k]}
            lines.append(f"  {json.dumps(option)}: {json.dumps(shown)}")
        body = ",\n".join(lines)
        return f'{{\n "sglang_version": {json.dumps(self.sglang_version)},\n "flags": {{\n{body}\n }}\n}}\n'

    @classmethod
    def from_json(cls, text: str) -> ServerFlags:
        raw = json.loads(text)
        flags = {}
        for option, fields in raw["flags"].items():
            choices = fields.pop("choices", None)
            flags[option] = ServerFlag(choices=None if choices is None else tuple(choices), **fields)
        return cls(sglang_version=raw["sglang_version"], flags=flags)


class ServerArgsError(ValueError):
    """SGLang's parser would refuse these arguments (it prints the message and exits)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ServerArgsError(message)


def server_parser(flags: ServerFlags) -> argparse.ArgumentParser:
    """SGLang's server parser as far as option forms go: exact names (no abbreviations), value or switch, nargs,
    int/float/str types (SGLang's own parser functions take the value as a string here), choices."""
    parser = _Parser(prog="sglang serve", add_help=False, allow_abbrev=False)
    types = {"int": int, "float": float}
    for option, flag in flags.flags.items():
        if not flag.takes_value:
            parser.add_argument(option, dest=flag.dest, action="store_true")
            continue
        kwargs: dict[str, Any] = {"dest": flag.dest, "type": types.get(flag.value_type or "str", str)}
        if flag.nargs is not None:
            kwargs["nargs"] = flag.nargs
        if flag.choices is not None:
            kwargs["choices"] = flag.choices
        parser.add_argument(option, **kwargs)
    return parser


def parse_server_args(flags: ServerFlags, args: list[str]) -> dict[str, Any]:
    """{dest: value} of the options `args` gives, as SGLang's parser takes them. Raises ServerArgsError for an
    option SGLang does not define, one given twice, one whose choices SGLang computes only at start (they cannot
    be checked here), and whatever its parser refuses (a missing value, a wrong type, a value outside the choices)."""
    options = [a.partition("=")[0] for a in args if a.startswith("--")]
    problems = []
    unknown = [o for o in options if o not in flags.flags]
    if unknown:
        problems.append(f"not SGLang {flags.sglang_version} flags: {unknown}")
    dynamic = [o for o in options if o in flags.flags and flags.flags[o].dynamic_choices is not None]
    if dynamic:
        problems.append(f"choices of {dynamic} are computed at SGLang's start and cannot be checked here")
    if len(set(options)) != len(options):
        problems.append(f"a flag is given twice: {options}")
    if problems:
        raise ServerArgsError("; ".join(problems))
    namespace = server_parser(flags).parse_args(args)
    given = {flags.flags[o].dest for o in options}
    return {dest: value for dest, value in vars(namespace).items() if dest in given}


def vendored_server_flags() -> ServerFlags:
    """The copy under tests/data, derived from the SGLang version it names."""
    return ServerFlags.from_json(SERVER_FLAGS_PATH.read_text())


def derive_server_flags(source: Path) -> ServerFlags:
    """Parse the server's flags out of SGLang's source (a wheel, or a directory holding the unpacked `sglang/`).
    Raises ValueError naming the file and definition it cannot read: a flag is never silently left out."""
    modules = _Modules(source_reader(source))
    server_args = modules.tree(SERVER_ARGS)
    flags: dict[str, ServerFlag] = {}
    for module, name in _namespaces(server_args, modules):
        for node in _class(modules.tree(module), name, module).body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                _add(flags, _field_flags(node, module=module, modules=modules), where=f"{module}:{name}")
    add_cli_args = _method(_class(server_args, "ServerArgs", SERVER_ARGS), "add_cli_args")
    for call in ast.walk(add_cli_args):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument":
            _add(flags, _argument_flags(call, modules=modules), where=f"{SERVER_ARGS}:add_cli_args")
    version = _version(modules.tree(VERSION), modules)
    return ServerFlags(sglang_version=version, flags=dict(sorted(flags.items())))


class _Modules:
    """SGLang's modules by path, parsed once; resolves module-level constants across `from X import Y`."""

    def __init__(self, read: Callable[[str], str]) -> None:
        self.read = read
        self._trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        """The parsed module at `path` (`a/b.py`, or `a/b/__init__.py` for a package)."""
        if path not in self._trees:
            try:
                text = self.read(path)
            except (KeyError, OSError):  # a package: zipfile raises KeyError, a directory OSError
                text = self.read(path.removesuffix(".py") + "/__init__.py")
            self._trees[path] = ast.parse(text)
        return self._trees[path]

    def evaluate(self, node: ast.AST, module: str, scope: list[ast.stmt] | None = None) -> Any:
        """The value of a constant expression (literals, `+`, names bound to constants, `Class.ATTR`); raises
        _NotConstant for anything computed."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            return [self.evaluate(e, module, scope) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.evaluate(node.left, module, scope) + self.evaluate(node.right, module, scope)
        if isinstance(node, ast.Name):
            return self._name(node.id, module, scope)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, owner_module = self._definition(node.value.id, module)
            if isinstance(owner, ast.ClassDef):
                return self._name(node.attr, owner_module, owner.body)
        raise _NotConstant(ast.unparse(node))

    def _name(self, name: str, module: str, scope: list[ast.stmt] | None) -> Any:
        for statement in scope or ():
            value = _assigned(statement, name)
            if value is not None:
                return self.evaluate(value, module, scope)
        value, value_module = self._definition(name, module)
        if isinstance(value, ast.expr):
            return self.evaluate(value, value_module)
        raise _NotConstant(name)

    def _definition(self, name: str, module: str) -> tuple[ast.AST | None, str]:
        """What `name` is bound to at the top of `module` (an expression or a class), following imports."""
        for statement in self.tree(module).body:
            if isinstance(statement, ast.ClassDef) and statement.name == name:
                return statement, module
            value = _assigned(statement, name)
            if value is not None:
                return value, module
            if isinstance(statement, ast.ImportFrom) and statement.module and statement.level == 0:
                for alias in statement.names:
                    if (alias.asname or alias.name) == name and statement.module.startswith("sglang."):
                        return self._definition(alias.name, _module_path(statement.module))
        return None, module


class _NotConstant(Exception):
    pass


def _assigned(statement: ast.stmt, name: str) -> ast.expr | None:
    if isinstance(statement, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in statement.targets):
        return statement.value
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.value:
        return statement.value if statement.target.id == name else None
    return None


def _module_path(dotted: str) -> str:
    return dotted.replace(".", "/") + ".py"


def _class(module: ast.Module, name: str, path: str) -> ast.ClassDef:
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise ValueError(f"{path} defines no class {name}")


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise ValueError(f"{SERVER_ARGS}: class {cls.name} defines no {name}")


def _namespaces(server_args: ast.Module, modules: _Modules) -> list[tuple[str, str]]:
    """(module path, class name) of every class in `_INPUT_NAMESPACES`, in order."""
    listed = next((_assigned(n, NAMESPACE_LIST) for n in server_args.body if _assigned(n, NAMESPACE_LIST)), None)
    if not isinstance(listed, ast.List) or not all(isinstance(e, ast.Name) for e in listed.elts):
        raise ValueError(f"{SERVER_ARGS} assigns no list of class names to {NAMESPACE_LIST}")
    found = []
    for element in listed.elts:
        cls, module = modules._definition(element.id, SERVER_ARGS)
        if not isinstance(cls, ast.ClassDef):
            raise ValueError(f"{SERVER_ARGS}: {NAMESPACE_LIST} names {element.id}, which no sglang module defines")
        found.append((module, element.id))
    return found


def _add(flags: dict[str, ServerFlag], new: dict[str, ServerFlag], *, where: str) -> None:
    for option, flag in new.items():
        if option in flags:
            raise ValueError(f"{where}: option {option} is registered twice")
        flags[option] = flag


def _head(node: ast.expr) -> str:
    """`Optional` for `Optional[...]` / `typing.Optional[...]`, the bare name for a name."""
    target = node.value if isinstance(node, ast.Subscript) else node
    if isinstance(target, ast.Attribute):
        return target.attr
    return target.id if isinstance(target, ast.Name) else ""


def _arguments(node: ast.Subscript) -> list[ast.expr]:
    return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]


def _is_none(node: ast.expr) -> bool:
    return (isinstance(node, ast.Constant) and node.value is None) or _head(node) == "NoneType"


def _union_members(node: ast.expr) -> list[ast.expr] | None:
    """The members of `Optional[X]`, `Union[...]` or `X | Y`, flattened; None for anything else."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return [*(_union_members(node.left) or [node.left]), *(_union_members(node.right) or [node.right])]
    if isinstance(node, ast.Subscript) and _head(node) in ("Optional", "Union"):
        members = [m for a in _arguments(node) for m in (_union_members(a) or [a])]
        return [*members, ast.Constant(None)] if _head(node) == "Optional" else members
    return None


def _type_name(node: ast.expr | None) -> str:
    """argparse's `type` as `_infer_type_func` picks it: int and float as named, str for everything else."""
    name = _head(node) if node is not None else ""
    return name if name in ("int", "float") and not isinstance(node, ast.Subscript) else "str"


def _field_flags(node: ast.AnnAssign, *, module: str, modules: _Modules) -> dict[str, ServerFlag]:
    """The options one `name: A[T, ...] = default` field registers (none without CLI metadata)."""
    annotation = node.annotation
    if not (isinstance(annotation, ast.Subscript) and _head(annotation) in ("A", "Annotated")):
        return {}
    field_type, *metadata = _arguments(annotation)
    arg: dict[str, ast.expr] | None = None
    for meta in metadata:  # the first Arg(...) or help string wins, as `_unwrap_annotated` reads them
        if isinstance(meta, ast.Call) and _head(meta.func) == "Arg":
            arg = {k.arg: k.value for k in meta.keywords if k.arg}
            break
        if isinstance(meta, ast.Constant | ast.JoinedStr) or (isinstance(meta, ast.BinOp) and _is_text(meta)):
            arg = {}
            break
    if arg is None or _literal(arg.get("no_cli"), module, modules) is True:
        return {}
    name = node.target.id
    cli_name = _literal(arg.get("cli_name"), module, modules) or "--" + name.replace("_", "-")
    options = [cli_name, *(_literal(arg.get("aliases"), module, modules) or [])]
    if "action" in arg:
        kwargs = arg.get("action_kwargs")
        extra = {k.value: v for k, v in zip(kwargs.keys, kwargs.values, strict=True)} if kwargs else {}
        return _action_flags(options, dest=name, action=arg["action"], kwargs=extra, module=module, modules=modules)
    choices, dynamic = _choices(arg.get("choices"), module, modules)
    nargs = _literal(arg.get("nargs"), module, modules)
    parser = arg.get("type_parser")
    parser_name = ast.unparse(parser) if parser is not None else None
    members = _union_members(field_type)
    inner = field_type
    if members is not None:
        present = [m for m in members if not _is_none(m)]
        inner = present[0] if len(present) == 1 else field_type
    if isinstance(inner, ast.Subscript) and _head(inner) == "Literal":
        literal = [modules.evaluate(v, module) for v in _arguments(inner)]
        value_type = parser_name or {int: "int", float: "float"}.get(type(literal[0]) if literal else str, "str")
        flag = ServerFlag(dest=name, takes_value=True, value_type=value_type, choices=tuple(choices or literal))
    elif isinstance(inner, ast.Subscript) and _head(inner) in ("List", "list") and parser is None:
        flag = ServerFlag(
            dest=name,
            takes_value=True,
            nargs=nargs or "+",
            value_type=_type_name(_arguments(inner)[0]),
            choices=choices,
            dynamic_choices=dynamic,
        )
    elif _head(inner) == "bool" and not isinstance(inner, ast.Subscript):
        flag = ServerFlag(dest=name, takes_value=False)
    else:
        required = _literal(arg.get("required"), module, modules)
        flag = ServerFlag(
            dest=name,
            takes_value=True,
            nargs=nargs,
            value_type=parser_name or _type_name(inner),
            choices=choices,
            dynamic_choices=dynamic,
            is_required=required is True or (required is None and node.value is None),
        )
    return dict.fromkeys(options, flag)


def _is_text(node: ast.expr) -> bool:
    if isinstance(node, ast.BinOp):
        return _is_text(node.left) and _is_text(node.right)
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _literal(node: ast.expr | None, module: str, modules: _Modules) -> Any:
    if node is None:
        return None
    try:
        return modules.evaluate(node, module)
    except _NotConstant:
        raise ValueError(f"{module}: {ast.unparse(node)} is not a constant") from None


def _choices(node: ast.expr | None, module: str, modules: _Modules) -> tuple[tuple[Any, ...] | None, str | None]:
    if node is None:
        return None, None
    try:
        return tuple(modules.evaluate(node, module)), None
    except _NotConstant:
        return None, ast.unparse(node)


def _action_flags(
    options: list[str], *, dest: str, action: ast.expr, kwargs: dict[str, ast.expr], module: str, modules: _Modules
) -> dict[str, ServerFlag]:
    """Options with an explicit argparse action: a switch unless the action consumes values (its nargs)."""
    name = action.value if isinstance(action, ast.Constant) else _head(action)
    nargs = _literal(kwargs.get("nargs"), module, modules)
    choices, dynamic = _choices(kwargs.get("choices"), module, modules)
    value_type = ast.unparse(kwargs["type"]) if "type" in kwargs else "str"
    if name == "BooleanOptionalAction":
        negated = ["--no-" + o[2:] for o in options if o.startswith("--")]
        return dict.fromkeys([*options, *negated], ServerFlag(dest=dest, takes_value=False))
    if name in _SWITCH_ACTIONS:
        return dict.fromkeys(options, ServerFlag(dest=dest, takes_value=False))
    if name in ("store", "append", "extend", "DeprecatedAliasStoreAction"):
        takes_value = nargs != 0
    elif name in ("DeprecatedAction", "DeprecatedStoreTrueAction", "DeprecatedStoreConstAction"):
        takes_value = (
            "nargs" in kwargs and nargs != 0
        )  # these default to nargs=0 (sglang/srt/arg_groups/argparse_actions.py)
    elif name == "LoRAPathAction":  # a plain argparse.Action: the nargs it is given
        takes_value = nargs != 0
    else:
        raise ValueError(f"{module}: option {options[0]} uses action {name}, whose value form is not known here")
    if not takes_value:
        return dict.fromkeys(options, ServerFlag(dest=dest, takes_value=False))
    flag = ServerFlag(
        dest=dest, takes_value=True, nargs=nargs, value_type=value_type, choices=choices, dynamic_choices=dynamic
    )
    return dict.fromkeys(options, flag)


def _argument_flags(call: ast.Call, *, modules: _Modules) -> dict[str, ServerFlag]:
    """One `parser.add_argument("--name", ..., type=..., choices=..., action=..., dest=...)` call."""
    options = [_literal(a, SERVER_ARGS, modules) for a in call.args]
    kwargs = {k.arg: k.value for k in call.keywords if k.arg}
    dest = _literal(kwargs.get("dest"), SERVER_ARGS, modules) or options[0].lstrip("-").replace("-", "_")
    if "action" in kwargs:
        return _action_flags(
            options, dest=dest, action=kwargs["action"], kwargs=kwargs, module=SERVER_ARGS, modules=modules
        )
    choices, dynamic = _choices(kwargs.get("choices"), SERVER_ARGS, modules)
    flag = ServerFlag(
        dest=dest,
        takes_value=True,
        nargs=_literal(kwargs.get("nargs"), SERVER_ARGS, modules),
        value_type=ast.unparse(kwargs["type"]) if "type" in kwargs else "str",
        choices=choices,
        dynamic_choices=dynamic,
        is_required=_literal(kwargs.get("required"), SERVER_ARGS, modules) is True,
    )
    return dict.fromkeys(options, flag)


def _version(module: ast.Module, modules: _Modules) -> str:
    for statement in module.body:
        value = _assigned(statement, "__version__")
        if value is not None:
            version = _literal(value, VERSION, modules)
            if isinstance(version, str):
                return version
    raise ValueError(f"{VERSION} assigns no string to __version__")
