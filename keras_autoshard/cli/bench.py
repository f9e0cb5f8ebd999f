"""The `bench` command's link to the benchmarks of a source checkout.

The benchmarks (`benchmarks/`) are not part of the installed package: they
live beside it in the repository. This module finds that checkout and loads
its `benchmarks.cli_bench`, or says why it cannot.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from keras_autoshard.errors import BenchmarkSetupError


def find_source_root() -> str:
    """The checkout holding `benchmarks/`.

    Returns:
        The current directory if it has `benchmarks/`, else the directory
        above the `keras_autoshard` package if that has one.

    Raises:
        BenchmarkSetupError: neither has the benchmarks.
    """
    package_parent = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )
    for candidate in (os.getcwd(), package_parent):
        if os.path.isfile(os.path.join(candidate, "benchmarks", "cli_bench.py")):
            return candidate
    raise BenchmarkSetupError(
        "The benchmarks live in the source checkout (benchmarks/), which is not "
        "installed with the package: run `keras-autoshard bench` from the "
        "repository root."
    )


def load_benchmarks() -> ModuleType:
    """The checkout's `benchmarks.cli_bench` module (its `BENCHMARKS` table,
    `run_bench` and `list_benchmarks`)."""
    root = find_source_root()
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("benchmarks.cli_bench")
