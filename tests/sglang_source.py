"""SGLang's source, read rather than imported: the installed pinned release and the wheel of
the newest checked one (hack/setup puts both in place; `tool.rljob.sglang` in pyproject.toml
names them). Modules that import SGLang's kernels (its HTTP server, its model runner) are
read with `ast` here; nothing is copied from them.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PINS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["rljob"]["sglang"]
RELEASE: str = PINS["release"]
NEWEST: str = PINS["newest-checked"]
WHEELS = REPO / ".venv" / "sglang-wheels"
SETUP_HINT = "run hack/setup, which installs the pinned SGLang and fetches the newest's wheel"


def installed_path(relative: str) -> Path:
    """A file of the installed sglang package, which must be the pinned release."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"sglang is not installed: {SETUP_HINT}")
    installed = importlib.metadata.version("sglang")
    if installed != RELEASE:
        raise RuntimeError(f"sglang {installed} is installed, the pin is {RELEASE}: {SETUP_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / relative


@functools.cache
def source(release: str, relative: str) -> str:
    """The text of `sglang/<relative>` in `release` (the pinned or the newest checked)."""
    if release == RELEASE:
        return installed_path(relative).read_text()
    wheels = sorted(WHEELS.glob(f"sglang-{release}-*.whl"))
    if not wheels:
        raise RuntimeError(f"no wheel of sglang {release} in {WHEELS}: {SETUP_HINT}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return wheel.read(f"sglang/{relative}").decode()


@dataclass(frozen=True)
class Route:
    methods: frozenset[str]
    # The type the handler's first parameter is declared with (SGLang's io_struct request
    # type, whose fields are the body's), or None when the handler reads no body.
    request_type: str | None
    handler: ast.AsyncFunctionDef | ast.FunctionDef


def _decorator_routes(node: ast.expr) -> list[tuple[str, frozenset[str]]]:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "app"
            and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return []
    verb = node.func.attr
    if verb in ("get", "post", "put", "delete"):
        return [(node.args[0].value, frozenset({verb.upper()}))]
    if verb == "api_route":
        listed = next((k.value for k in node.keywords if k.arg == "methods"), None)
        assert isinstance(listed, ast.List), ast.dump(node)
        return [(node.args[0].value,
                 frozenset(str(e.value) for e in listed.elts if isinstance(e, ast.Constant)))]
    return []


def _request_type(handler: ast.AsyncFunctionDef | ast.FunctionDef) -> str | None:
    if not handler.args.args:
        return None
    annotation = handler.args.args[0].annotation
    # Later releases write `obj: Annotated[Type, Body()]`.
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.slice, ast.Tuple):
        annotation = annotation.slice.elts[0]
    name = annotation.id if isinstance(annotation, ast.Name) else None
    return None if name in (None, "Request") else name


@functools.cache
def route_table(release: str) -> dict[str, Route]:
    """Every route `app` of SGLang's HTTP server declares with a literal path."""
    tree = ast.parse(source(release, "srt/entrypoints/http_server.py"))
    table: dict[str, Route] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            for decorator in node.decorator_list:
                for path, methods in _decorator_routes(decorator):
                    table[path] = Route(methods, _request_type(node), node)
    return table


def returned_keys(handler: ast.AsyncFunctionDef | ast.FunctionDef) -> set[str]:
    """The literal keys of the dicts a handler builds (its answer's fields), `**` spreads
    aside."""
    return {k.value for node in ast.walk(handler) if isinstance(node, ast.Dict)
            for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def function(release: str, relative: str, cls: str | None, name: str
             ) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """A function (or method of `cls`) of SGLang's source, as its syntax tree."""
    body = ast.parse(source(release, relative)).body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                and n.name == name)


def module_constant(release: str, relative: str, name: str) -> object:
    """The literal value a module of SGLang assigns to `name`."""
    for node in ast.parse(source(release, relative)).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name):
            return ast.literal_eval(node.value)
    raise LookupError(f"sglang {release} {relative} assigns no {name}")


def sources_under(release: str, folder: str) -> list[str]:
    """The text of every `.py` file of `sglang/<folder>` (not below it) in `release`."""
    if release == RELEASE:
        return [p.read_text() for p in sorted(installed_path(folder).glob("*.py"))]
    wheels = sorted(WHEELS.glob(f"sglang-{release}-*.whl"))
    if not wheels:
        raise RuntimeError(f"no wheel of sglang {release} in {WHEELS}: {SETUP_HINT}")
    prefix = f"sglang/{folder.rstrip('/')}/"
    with zipfile.ZipFile(wheels[0]) as wheel:
        return [wheel.read(n).decode() for n in sorted(wheel.namelist())
                if n.startswith(prefix) and n.endswith(".py") and "/" not in n[len(prefix):]]


def server_arg_fields(release: str) -> set[str]:
    """The server arguments a release declares (each is the flag `--name-with-dashes` and a
    key of `/get_server_info`): ServerArgs's fields in 0.5.3, the argument groups' fields
    in later releases."""
    texts = [source(release, "srt/server_args.py")]
    if release != RELEASE:
        texts += sources_under(release, "srt/arg_groups/fields")
    return {n.target.id for text in texts for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
