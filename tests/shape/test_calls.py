"""The shape of the calls, checked like the imports (test_layers.py): no module below lantern.api touches a private
attribute of an object from a layer above it, nor writes another object's attributes through `__dict__`; the engine
and the planner read of their host only what their protocols declare (lantern.engine.host, lantern.plan.host), and
Pipeline is that host."""
import ast
import shutil
import tomllib
from pathlib import Path

import pytest

import lantern
from lantern.engine.host import Host
from lantern.plan.host import PlanHost

PACKAGE = Path(lantern.__file__).resolve().parent
REPO = PACKAGE.parent
SELF = ("self", "cls")
# the names a module calls its host by: the engine's `host`, the planner's `pipe` (and the base mode's `base_pipe`)
HOST_NAMES = ("host", "pipe", "base_pipe", "pipeline")


def layers(pyproject: Path) -> list[list[str]]:
    """The layers contract of pyproject.toml, top first, each layer's packages."""
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    contract = next(c for c in config if c["type"] == "layers")
    return [[name.strip() for name in layer.split("|")] for layer in contract["layers"]]


def module_name(path: Path, package: Path) -> str:
    return ".".join(("lantern", *path.relative_to(package).with_suffix("").parts)).removesuffix(".__init__")


def layer_of(module: str, stack: list[list[str]]) -> int | None:
    """The index of the module's layer (0: the top), or None for a module in none (lantern/__init__.py)."""
    return next((i for i, layer in enumerate(stack) for top in layer
                 if module == top or module.startswith(top + ".")), None)


def private_members(tree: ast.Module) -> set[str]:
    """Private names the module's classes define: methods, class attributes and `self._name = ...` assignments."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
                names.add(node.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in SELF


def upward_calls(package: Path, pyproject: Path) -> list[str]:
    """Every place a module below lantern.api reads or writes `obj._name` where `_name` is a private member of a
    class in a layer above the module (obj not the module's own self or cls), or touches `obj.__dict__`."""
    stack = layers(pyproject)
    api = next(i for i, layer in enumerate(stack) if "lantern.api" in layer)
    trees = {path: ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}
    layer = {path: layer_of(module_name(path, package), stack) for path in trees}
    defined_at: dict[str, set[int]] = {}  # private name -> the layers whose classes define it
    for path, tree in trees.items():
        for name in private_members(tree):
            defined_at.setdefault(name, set()).add(layer[path])
    found = []
    for path, tree in trees.items():
        here = layer[path]
        if here is None or here <= api:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or _on_self(node):
                continue
            above = any(at is not None and at < here for at in defined_at.get(node.attr, ()))
            if node.attr == "__dict__" or above:
                found.append(f"lantern/{path.relative_to(package).as_posix()}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_below_the_api_touches_a_private_attribute_from_above():
    found = upward_calls(PACKAGE, REPO / "pyproject.toml")
    assert found == [], "calls back up a layer through a private attribute or __dict__:\n" + "\n".join(found)


@pytest.mark.parametrize("bad, report", [
    ("def peek(host):\n    return host._runners\n", "host._runners"),
    ("def share(host, key):\n    host.__dict__['model_key'] = key\n", "host.__dict__"),
])
def test_an_upward_private_access_breaks_the_check(tmp_path, bad, report):
    """The check is not vacuous: an engine function that reads Pipeline's private runners, or writes its cached
    key through __dict__, is found and named."""
    shutil.copytree(PACKAGE, tmp_path / "lantern", ignore=shutil.ignore_patterns("assets", "__pycache__"))
    engine = tmp_path / "lantern" / "engine" / "engine.py"
    engine.write_text(engine.read_text() + "\n\n" + bad)
    found = upward_calls(tmp_path / "lantern", REPO / "pyproject.toml")
    assert len(found) == 1 and found[0].startswith("lantern/engine/engine.py:") and found[0].endswith(report), found


def protocol_members(protocol: type) -> set[str]:
    return set().union(*(vars(base).get("__annotations__", {}).keys() | {n for n in vars(base) if not n.startswith("_")}
                         for base in protocol.__mro__ if base is not object))


def host_reads(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) of each attribute read on a host: a name in HOST_NAMES, or self.<such a name>."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Attribute) and _on_self(owner):
            owner = ast.Name(owner.attr)
        if isinstance(owner, ast.Name) and owner.id in HOST_NAMES:
            out.append((node.lineno, node.attr))
    return out


@pytest.mark.parametrize("folder, protocol", [("engine", Host), ("plan", PlanHost)])
def test_the_engine_and_the_planner_read_only_what_their_host_declares(folder, protocol):
    declared = protocol_members(protocol)
    undeclared = [f"lantern/{folder}/{path.name}:{line}: .{attr}"
                  for path in sorted((PACKAGE / folder).glob("*.py")) for line, attr in host_reads(path)
                  if attr not in declared]
    assert undeclared == [], f"reads of the host that {protocol.__name__} does not declare:\n" + "\n".join(undeclared)


def test_pipeline_is_the_host_the_engine_and_the_planner_declare(tiny):
    from lantern.api import Pipeline
    pipe = Pipeline(*tiny, backend="cpu")
    assert isinstance(pipe, Host) and isinstance(pipe, PlanHost)
