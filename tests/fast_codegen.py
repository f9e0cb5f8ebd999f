"""XLA's machine-code generation at its lowest optimization level, for the
suite's compiles.

`--xla_backend_optimization_level=0` sets the optimization level of the
LLVM back end that turns XLA's optimized HLO into machine code; the HLO
passes before it (sharding propagation and the partitioner's collectives,
fusion, scheduling, buffer assignment) are the same, so every program the
tests read (optimized HLO, collectives and their bytes, the compiled
memory analysis) is the one the default level gives
(`tests/test_fast_codegen.py` checks that, on XLA:CPU and XLA:GPU
deviceless). Measured on this 2-core machine: `tests/test_moe_hub.py`
alone took 297.8 CPU-seconds at the default level and 175.6 with this one.
The generated code runs slower, which the suite's small models do not feel,
and it rounds as the default level does up to reduction order (the parity
tests compare two programs compiled alike).
"""

import os

FLAG = "--xla_backend_optimization_level=0"


def with_flag(flags: str) -> str:
    """`flags` (an `XLA_FLAGS` value) with `FLAG` appended once."""
    return flags if FLAG in flags.split() else f"{flags} {FLAG}".strip()


def subprocess_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a JAX subprocess that picks its own
    device count: `XLA_FLAGS` is `FLAG` alone (the simulated-device flag of
    this process is dropped), then `overrides`."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = FLAG
    env.update(overrides)
    return env
