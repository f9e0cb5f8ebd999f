"""`tools.python_source.parse` survives the CPython 3.11 parser bug that failed
CI: a finalizer that formats a traceback (and so parses source) running while
a syntax tree is built."""

from __future__ import annotations

import ast
import gc
import pathlib
import traceback

from tools import python_source

SOURCE = (
    pathlib.Path(__file__).parent.parent / "keras_autoshard/plans/sharding_plan.py"
).read_text()


def _fail():
    return {}["missing"]


class _LogsItsErrorWhenCollected:
    """Like an asyncio future whose exception nobody retrieved."""

    def __init__(self):
        self.cycle = self
        try:
            _fail()
        except KeyError as error:
            self.error = error

    def __del__(self):
        traceback.format_exception(self.error)


def _system_errors(parse) -> int:
    thresholds = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    errors = 0
    try:
        for _ in range(40):
            for _ in range(20):
                _LogsItsErrorWhenCollected()
            try:
                parse(SOURCE)
            except SystemError:
                errors += 1
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
    return errors


def test_parse_gives_ast_parse_tree_even_when_finalizers_parse_meanwhile():
    assert ast.dump(python_source.parse(SOURCE)) == ast.dump(ast.parse(SOURCE))
    assert _system_errors(python_source.parse) == 0
