"""README.md is documentation whose numbers come from results files, and its test command is what CI runs."""
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", REPO / "tools" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_results_block_is_what_the_tool_generates_from_the_committed_results():
    tables = readme_tables()
    assert tables.replace_block(README, tables.block()) == README, "run python tools/readme_tables.py"
    assert tables.DEFAULT_RESULTS in README  # the file is named beside its numbers


def test_the_tool_rewrites_only_its_block():
    tables = readme_tables()
    stale = README.replace("| cpu fp32 | ", "| cpu fp32 (stale) | ", 1)
    assert stale != README and tables.replace_block(stale, tables.block()) == README


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    command = re.search(r"^TEST_COMMAND='(.+)'$", ci, re.M).group(1)
    assert ci.count('bash -c "$TEST_COMMAND"') == 1
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [line.strip() for line in quick_start.splitlines() if line.startswith("    ")]
    assert len(commands) == 2 and commands[1] == command


def test_the_readme_is_documentation_not_a_lab_notebook():
    assert 150 <= len(README.splitlines()) <= 250
    assert not re.search(r"\d\d:\d\d UTC|20\d\d-\d\d-\d\d", README), "no timestamps"
    outside = README.split("<!-- results:begin -->")[0] + README.split("<!-- results:end -->")[1]
    assert not re.search(r"\d\.\d\dx", outside), "speed-ups only in the generated block, beside their file"
    for link in re.findall(r"\]\(((?:docs|results)/[^)#]+)\)", README):
        assert (REPO / link).is_file(), link


def test_every_relative_link_in_the_docs_resolves():
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / link).exists(), f"{page.name}: {link}"
