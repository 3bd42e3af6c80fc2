from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import asyncddp


def test_all_is_sorted_and_complete() -> None:
    public = {name for name in dir(asyncddp) if not name.startswith("_")} - {
        "annotations",  # from __future__
        "testing",  # a submodule, imported as asyncddp.testing
        "distributed",  # a submodule, asyncddp.distributed (the trainer imports it)
    }
    assert set(asyncddp.__all__) - {"__version__"} == public
    assert asyncddp.__all__ == sorted(asyncddp.__all__)


def test_version_matches_the_package_metadata() -> None:
    assert asyncddp.__version__ == importlib.metadata.version("asyncddp")


def test_docstrings_are_markdown_for_the_api_pages() -> None:
    # mkdocstrings renders docstrings as Markdown: a Sphinx role showed on docs/api.md as
    # ":class:" before the name (29 times).
    role = re.compile(r":(class|func|meth|attr|exc|mod|data|obj):`")
    found = [
        f"{path.name}:{number}"
        for path in sorted(Path(asyncddp.__file__).parent.glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if role.search(line)
    ]
    assert not found, f"Sphinx roles in docstrings (write `Name` instead): {found}"
