"""The XLA flags the suite compiles with, in its own processes and in the
subprocesses it starts.

`--xla_backend_optimization_level=0` has LLVM generate the machine code of
every XLA:CPU program without optimizing it. The level acts after every HLO
pass: the optimized HLO, the schedule and the buffer assignment (what the
tests read: collectives, bytes, memory analysis) are the ones the default
level makes (`tests/test_compiled_report.py` compares both on a planned,
rematerialized GPT-2 train step), and the programs run the same operations.
Compiling takes about half as long (the coverage sweep's, 780 s -> 430 s
in a whole-suite run), running them longer, which the suite's small models
do not notice. Results differ from the default level's by rounding only
(fused multiply-adds, the order of a vectorized reduction): both sides of
every parity check are compiled at the same level, and a model whose
training amplifies rounding is judged by its measured sensitivity
(`tests.parity.adam_steps_sensitivity`).

The user-experience tests (`tests/test_readme.py`, `tests/test_wheel.py`,
`tests/test_cli_target.py`, `tests/test_devices.py`) run subprocesses with
XLA's defaults, as a user's shell has them.
"""

import os

SUITE_XLA_FLAGS = "--xla_backend_optimization_level=0"


def with_suite_flags(flags: str) -> str:
    """`flags` (an `XLA_FLAGS` value) with the suite's code-generation level,
    unless it sets a level of its own."""
    if "--xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {SUITE_XLA_FLAGS}".strip()


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a subprocess that sets its own device
    count: `XLA_FLAGS` holds the suite's flags alone (not this process's
    simulated devices), then `overrides`."""
    env = dict(os.environ, XLA_FLAGS=SUITE_XLA_FLAGS)
    env.update(overrides)
    return env
