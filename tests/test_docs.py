"""The front door: the README and docs/ stay short and written for users, their links resolve, their settings
tables name every setting the code has, with its default, and the architecture page's picture is the package as
it is."""

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from hf_eagle31.configuration import SPECULATION_DEFAULTS, SpeculationSettings

ROOT = Path(__file__).resolve().parent.parent


def settings_table(path: Path) -> dict[str, str]:
    """`setting` -> `default` from a Markdown table of one line per setting."""
    return dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", path.read_text(), re.MULTILINE))


@pytest.mark.parametrize("page", ["README.md", "docs/settings.md"])
def test_the_settings_tables_name_every_setting_once_with_its_default(page):
    documented = settings_table(ROOT / page)
    assert list(documented) == [field.name for field in dataclasses.fields(SpeculationSettings)]
    defaults = {**SPECULATION_DEFAULTS, "sampling_shape": None, "batch_shapes": {}}
    assert documented == {name: repr(value).replace("'", '"') for name, value in defaults.items()}


def test_the_readme_is_short_and_docs_are_pages_not_diaries():
    assert len((ROOT / "README.md").read_bytes()) < 10_000
    pages = sorted((ROOT / "docs").glob("*.md"))
    lines = {page.name: len(page.read_text().splitlines()) for page in pages}
    assert sum(lines.values()) < 1500 and max(lines.values()) <= 300, lines
    dated = [page.name for page in pages if re.search(r"^#+ .*20\d\d-\d\d-\d\d", page.read_text(), re.MULTILINE)]
    assert dated == []  # no dated sections: results carry their date in a line, past runs live in git


def test_every_relative_link_of_the_readme_and_docs_names_a_file_that_exists():
    links = [(page, target) for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text())
             if not re.match(r"[a-z]+:|#", target)]
    assert len(links) > 20  # the pattern still finds the pages' links
    assert [f"{page.name}: {target}" for page, target in links
            if not (page.parent / target.split("#")[0]).exists()] == []


def architecture_tool():
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "tools" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_picture_is_the_import_graph_as_it_is():
    tool = architecture_tool()
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert tool.redrawn(page) == page, "docs/architecture.md's picture is out of date: run `make architecture`"
