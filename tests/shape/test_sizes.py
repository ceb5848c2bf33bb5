"""The planner earns its size (issue 59): the code that plans a run (lantern/plan, lantern/profile, the `profile`
command and the service's planning) stays smaller, in lines, than the decoding and engine core it plans for."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "lantern"
PLANNING = ("plan", "profile", "cli/profile.py", "serve/planning.py")
CORE = ("decoding", "engine")


def lines(parts) -> int:
    files = [p for part in parts for p in ([ROOT / part] if part.endswith(".py") else (ROOT / part).rglob("*.py"))]
    return sum(len(f.read_text().splitlines()) for f in files)


def test_the_planning_code_is_smaller_than_the_core_it_plans_for():
    planning, core = lines(PLANNING), lines(CORE)
    assert planning < core, f"planning code {planning} lines, decoding + engine {core}"


def test_the_count_reads_every_file_of_a_folder():
    assert lines(["plan"]) > lines(["plan/choose.py"]) > 0
