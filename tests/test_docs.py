"""The documentation site (mkdocs.yml, docs/) is checked like code: it builds with ``mkdocs build --strict`` (a
broken link or anchor, or a page missing from the nav, fails), README's links lead to files that exist, and the
parameter reference lists exactly what flows/params.py defines (scripts/gen_reference.py writes it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from scripts import gen_reference
from tasks.processes import stop_process
from tests.conftest import PROJECT_ROOT

#: A strict build of the whole site takes about a second; this only bounds a hang.
BUILD_TIMEOUT_S = 180


def test_the_site_builds_strictly(tmp_path) -> None:
    """Every page is in the nav, every link and anchor resolves, the theme and extensions load."""
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
               str(PROJECT_ROOT / "mkdocs.yml"), "--site-dir", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    process = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_process(process, grace_s=5)
        pytest.fail(f"mkdocs build did not finish within {BUILD_TIMEOUT_S} s: {' '.join(command)}")
    if "No module named mkdocs" in output:
        pytest.fail("mkdocs is not installed: the bootstrap installs it with the dev extra "
                    "(.venv/bin/pip install -c scripts/constraints.txt -e '.[dev,mlflow]')")
    assert process.returncode == 0, f"mkdocs build --strict failed (fix the pages or mkdocs.yml):\n{output}"
    assert (site / "index.html").is_file()
    for picture in ("compare-throughput.png", "compare-accuracy.png"):
        assert (site / picture).is_file(), f"docs/{picture} is not in the site"


def test_readme_links_lead_to_files_that_exist() -> None:
    readme = (PROJECT_ROOT / "README.md").read_text()
    targets = [target for target in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in target]
    assert targets, "README links into the documentation"
    missing = [target for target in targets if not (PROJECT_ROOT / target.split("#", 1)[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_parameter_reference_matches_the_code() -> None:
    page = gen_reference.PAGE.read_text()
    assert gen_reference.render(page) == page, (
        f"docs/reference/parameters.md is out of date with flows/params.py: run {gen_reference.REGENERATE}")


def test_the_command_line_reference_matches_the_parser() -> None:
    page = gen_reference.CLI_PAGE.read_text()
    assert gen_reference.render(page, gen_reference.cli_tables, gen_reference.CLI_PAGE) == page, (
        f"docs/reference/cli.md is out of date with flows/cli.py: run {gen_reference.REGENERATE}")
    assert "| `--platform` | `local` |" in page and "### `laneflow stop-server`" in page


def test_the_parameter_reference_names_every_field_with_its_description() -> None:
    """Independent of the generator: each field of the run's models appears in its own row, described."""
    from flows.params import DatasetArtifact, DataSource, TrainParams
    from tasks.platforms.base import ElasticWorkers

    rows = {line for line in gen_reference.PAGE.read_text().splitlines() if line.startswith("| `")}
    for model in (TrainParams, DataSource, DatasetArtifact, ElasticWorkers):
        for name, field in model.model_fields.items():
            description = " ".join((field.description or "").split()).replace("|", "\\|")
            assert description, f"{model.__name__}.{name} has no description: the UI's form shows it"
            assert any(row.startswith(f"| `{name}` |") and description in row for row in rows), (
                f"{model.__name__}.{name} is not documented in docs/reference/parameters.md: "
                f"run {gen_reference.REGENERATE}")


def test_the_blocks_reference_matches_the_code_and_describes_every_field() -> None:
    """The platform and ANF blocks' forms, field by field: generated, and checked here without the generator."""
    from tasks.anf import AnfVolume
    from tasks.platforms.cluster import ClusterPlatform
    from tasks.platforms.local import LocalPlatform

    page = gen_reference.BLOCKS_PAGE.read_text()
    assert gen_reference.render(page, gen_reference.block_tables, gen_reference.BLOCKS_PAGE) == page, (
        f"docs/reference/blocks.md is out of date with the blocks: run {gen_reference.REGENERATE}")
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    for block in (LocalPlatform, ClusterPlatform, AnfVolume):
        section = page.split(f"## `{block.__name__}`", 1)[1].split("\n## ", 1)[0]
        for name, field in block.model_fields.items():
            description = " ".join((field.description or "").split()).replace("|", "\\|")
            assert description, f"{block.__name__}.{name} has no description: the UI's form shows it"
            assert f"| `{name}` |" in section and description in section, (
                f"{block.__name__}.{name} is not documented in docs/reference/blocks.md")
    assert rows
