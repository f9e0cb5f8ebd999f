"""Parse Python source into a syntax tree, safely on Python 3.11.

On CPython 3.11 (3.11.7 here), `ast.parse` can fail with "SystemError: AST
constructor recursion depth mismatch" when the garbage collector runs while
the tree is built and a finalizer parses source itself. It happens in the
suite: a future that Orbax left unretrieved is collected mid-parse, asyncio
logs its exception, and the traceback formatter of 3.11 calls `ast.parse` on
the failing line (cpython gh-106905). Parsing with the collector paused
avoids it; the tree is the same.
"""

from __future__ import annotations

import ast
import gc


def parse(source: str) -> ast.Module:
    """The syntax tree of `source`, built with the garbage collector paused.

    Args:
        source: Python source text.

    Returns:
        The module's syntax tree, as `ast.parse(source)` gives it.

    Example:

    >>> parse("x = 1").body[0].targets[0].id
    'x'
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        if was_enabled:
            gc.enable()
