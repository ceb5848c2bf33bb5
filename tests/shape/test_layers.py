"""The shape of the code, checked: the layer contracts of pyproject.toml (import-linter), no import cycles, no
function-local imports but the marked optional extras, and a `lantern --help` that loads no model code."""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

import lantern

PACKAGE = Path(lantern.__file__).resolve().parent
REPO = PACKAGE.parent

# optional dependencies that cost an extra or seconds to import: the only imports allowed inside functions, each
# marked on its line with a comment saying which extra (or why)
HEAVY = ("transformers", "onnxruntime", "onnx", "habana_frameworks", "optimum", "ray", "starlette", "uvicorn",
         "prometheus_client", "matplotlib", "sklearn", "yaml", "torch._dynamo",
         "lantern.serve.app", "lantern.serve.service")  # lantern.serve's modules that import the serve extra


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts from root/pyproject.toml, on the lantern package under root."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())", "--no-cache", "--config", "pyproject.toml"],
                          cwd=root, env=env, capture_output=True, text=True)


def test_layer_contracts_hold():
    run = lint_imports(REPO)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_layer_crossed_upwards_breaks_the_contract(tmp_path):
    """The contract is not vacuous: a model module that imports the command line fails it, and the report names
    the import."""
    shutil.copytree(PACKAGE, tmp_path / "lantern", ignore=shutil.ignore_patterns("assets", "__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    gpt = tmp_path / "lantern" / "models" / "gpt.py"
    gpt.write_text(gpt.read_text() + "\nfrom lantern.cli import main  # a deliberately bad import\n")
    run = lint_imports(tmp_path)
    assert run.returncode == 1 and "BROKEN" in run.stdout
    assert "lantern.models.gpt -> lantern.cli" in run.stdout, run.stdout


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's groups of modules that import each other, directly or not (the groups of more than one)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            groups.append(group)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [sorted(g) for g in groups if len(g) > 1]


def test_no_import_cycles():
    graph = grimp.build_graph("lantern", cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    assert strongly_connected(edges) == []


def local_imports(path: Path) -> list[ast.stmt]:
    tree = ast.parse(path.read_text())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    found[sub.lineno] = sub
    return [found[line] for line in sorted(found)]


def is_heavy(node: ast.stmt) -> bool:
    names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    return all(any(n == h or n.startswith(h + ".") for h in HEAVY) for n in names)


def test_imports_are_at_module_level_but_the_marked_optional_extras():
    """A function-local import hides a dependency (and used to hide import cycles); only an optional heavy
    package may be imported where it is used, with a comment on the line saying why."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        lines = path.read_text().splitlines()
        nodes = local_imports(path)
        for node in nodes:
            line = lines[node.lineno - 1]
            if not is_heavy(node) or "#" not in line:
                wrong.append(f"lantern/{rel}:{node.lineno}: {line.strip()}")
    assert not wrong, "function-local imports (move them to the top, or mark an optional extra):\n" + "\n".join(wrong)


def test_help_loads_no_model_code():
    """`lantern --help` lists every command without importing any command's module: no torch, quickly."""
    code = ("import sys; from lantern.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('lantern.') and m.count('.') > 1))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    loaded = run.stdout.splitlines()[-1]
    assert "export-onnx" in run.stdout and loaded == "['lantern.cli.parsing', 'lantern.cli.signals']", run.stdout
