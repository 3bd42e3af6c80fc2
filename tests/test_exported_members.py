from __future__ import annotations

import importlib.metadata

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
