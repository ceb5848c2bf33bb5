"""The codebase's shape, as issue 47 measures it, for a checkout of lantern (this one by default):

    python tools/shape_metrics.py [CHECKOUT]

modules at the package root, command-line modules and their lines, import cycles between modules and between
packages (grimp's import graph, the one import-linter checks), imports inside functions, lines in plan/ and the
profile suite, lines in lantern/ in all, and the wall time of `lantern --help` (median of 5 fresh processes).
"""
from __future__ import annotations

import ast
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def cycles(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(edges.get(nxt, ())))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return groups


def imports_inside_functions(path: Path) -> int:
    """Each import statement inside a function counted once (a nested function's too)."""
    functions = [f for f in ast.walk(ast.parse(path.read_text())) if isinstance(f, (ast.FunctionDef,
                                                                                     ast.AsyncFunctionDef))]
    return len({id(n) for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))})


def lines(paths) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def help_wall(checkout: Path, runs: int = 5) -> float:
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import sys; from lantern.cli import main; sys.exit(main(['--help']))"],
                       cwd=checkout, env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"}, capture_output=True,
                       check=True)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def main() -> None:
    checkout = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    package = checkout / "lantern"
    sys.path.insert(0, str(checkout))
    files = sorted(package.rglob("*.py"))
    root = sorted(p.name for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    cli = [p for p in files  # lantern/cli/ now; modules named *cli* anywhere before
           if p.parent.name == "cli" or p.stem == "cli" or p.stem.startswith("cli_") or p.stem.endswith("_cli")]
    graph = grimp.build_graph("lantern", cache_dir=None)
    modules = sorted(graph.modules)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in modules}
    package_of = {m: ".".join(m.split(".")[:2]) for m in modules}
    package_edges: dict[str, set[str]] = {}
    for m, targets in edges.items():
        package_edges.setdefault(package_of[m], set()).update(package_of[t] for t in targets
                                                              if package_of[t] != package_of[m])
    module_cycles = cycles(modules, edges)
    package_cycles = cycles(sorted(set(package_of.values())), package_edges)
    plan_profile = [p for p in files if p.relative_to(package).parts[0] in ("plan", "profile")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    print(f"commit: {commit.stdout.strip() or 'unknown'}")
    print(f"modules at the package root: {len(root)} ({', '.join(root)})")
    print(f"command-line modules: {len(cli)}, {lines(cli)} lines")
    print(f"import cycles between modules: {len(module_cycles)} groups, {sum(map(len, module_cycles))} modules")
    print(f"import cycles between packages: {len(package_cycles)} groups, {sum(map(len, package_cycles))} packages")
    print(f"imports inside functions: {sum(imports_inside_functions(p) for p in files)}")
    print(f"lines in plan/ and the profile suite: {lines(plan_profile)}")
    print(f"lines in lantern/: {lines(files)} in {len(files)} files")
    print(f"`lantern --help` wall, median of 5: {help_wall(checkout):.3f} s")


if __name__ == "__main__":
    main()
