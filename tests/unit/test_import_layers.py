"""Imports flow one way through `runtime/rljob`: cli → driver → cluster (role handles) →
roles (rollout, engine, trainer, weightsync) → algo, kernels, model, checkpoint, reporting →
rljob_api. `engine` and `trainer` never import each other, and the operator never imports
the runtime. Read from every import statement, function-level ones included, with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "runtime" / "rljob"

# package → the rljob packages it may import (besides itself and rljob_api)
ALLOWED: dict[str, set[str]] = {
    "cli": {"driver", "cluster", "reporting"},
    "driver": {"cluster", "rollout", "trainer", "weightsync", "model", "checkpoint",
               "reporting"},
    "cluster": {"rollout", "engine", "trainer", "weightsync", "model", "checkpoint",
                "reporting"},
    "rollout": {"engine", "model", "reporting"},
    "engine": {"weightsync", "model", "reporting"},
    "trainer": {"rollout", "weightsync", "algo", "kernels", "model", "checkpoint",
                "reporting"},
    "weightsync": {"checkpoint", "reporting"},
    "algo": set(),
    "kernels": set(),
    "model": set(),
    "checkpoint": set(),
    "reporting": set(),
}
# Of `rollout`, the trainer reads only the records it trains on.
NARROW = {("trainer", "rollout"): {"rljob.rollout.sample"}}
BACKENDS = ("rljob.trainer.torch", "rljob.trainer.megatron")


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    top = ROOT / path.relative_to(ROOT).parts[0]  # runtime/ or operator/
    package = ".".join(path.relative_to(top).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            packages = ("rljob", *(f"rljob.{p}" for p in ALLOWED))
            out.update(f"{base}.{alias.name}" if base in packages else base
                       for alias in node.names)
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "rljob" and len(parts) > 1 else None


def test_every_module_sits_in_a_package() -> None:
    flat = sorted(p.name for p in RUNTIME.glob("*.py") if p.name != "__init__.py")
    assert flat == []
    assert {p.name for p in RUNTIME.iterdir() if (p / "__init__.py").exists()} == set(ALLOWED)


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT / "runtime").with_suffix("").parts)


def test_imports_flow_one_way() -> None:
    wrong: list[str] = []
    for path in sorted(RUNTIME.rglob("*.py")):
        own = _package(_module(path))
        if own is None:
            continue
        for module in sorted(_imports(path)):
            target = _package(module)
            if target is None or target == own:
                continue
            narrow = NARROW.get((own, target))
            if target not in ALLOWED[own] or (narrow is not None and module not in narrow):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert wrong == []


def test_the_api_model_and_the_operator_never_import_the_runtime() -> None:
    wrong = [f"{path.relative_to(ROOT)} imports {module}"
             for folder in (ROOT / "runtime" / "rljob_api", ROOT / "operator")
             for path in sorted(folder.rglob("*.py"))
             for module in _imports(path) if module.split(".")[0] == "rljob"]
    assert wrong == []


def test_trainer_backends_never_import_each_other() -> None:
    wrong = [f"{path.relative_to(ROOT)} imports {module}"
             for path in sorted((RUNTIME / "trainer").rglob("*.py"))
             for own in BACKENDS if _module(path).startswith(own)
             for module in _imports(path)
             if module.startswith(BACKENDS) and not module.startswith(own)]
    assert wrong == []


def test_the_driver_calls_other_processes_only_through_the_role_handles() -> None:
    """No Ray call in `driver/` or `cli/`: every `.remote()` and `ray.get` on another role's
    actor lives in `rljob.cluster`."""
    wrong: list[str] = []
    for folder in ("driver", "cli"):
        for path in sorted((RUNTIME / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)[:60]}"
                      for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and (
                          node.attr == "remote" or (isinstance(node.value, ast.Name)
                                                    and node.value.id == "ray"
                                                    and node.attr in ("get", "wait", "kill")))]
    assert wrong == []


# Where a Ray failure becomes an exit code and a reported reason: the one module of the
# driver that names Ray's exceptions.
RAY_ERRORS_READ_IN = "runtime/rljob/driver/outcome.py"


def test_only_the_outcome_module_of_the_driver_imports_ray() -> None:
    """The driver handles what roles said (TimeoutError, NonFiniteWeights), raised by the
    role handles as themselves, not how Ray carried it; only the outcome reads Ray's errors."""
    wrong = [str(path.relative_to(ROOT))
             for folder in ("driver", "cli")
             for path in sorted((RUNTIME / folder).rglob("*.py"))
             if any(m == "ray" or m.startswith("ray.") for m in _imports(path))
             and str(path.relative_to(ROOT)) != RAY_ERRORS_READ_IN]
    assert wrong == []
