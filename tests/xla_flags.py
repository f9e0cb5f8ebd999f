"""The XLA flags the suite compiles with, in its own processes and in the
subprocesses it starts.

`--xla_backend_optimization_level=0` has LLVM generate the machine code of
every XLA:CPU program without optimizing it. The level acts after every HLO
pass: the optimized HLO, the schedule and the buffer assignment (what the
tests read: collectives, bytes, memory analysis) are the ones the default
level makes (`tests/report/test_compiled_report.py` compares both on a planned,
rematerialized GPT-2 train step), and the programs run the same operations.
Compiling takes about half as long (the coverage sweep's, 780 s -> 430 s
in a whole-suite run), running them longer, which the suite's small models
do not notice. Results differ from the default level's by rounding only
(fused multiply-adds, the order of a vectorized reduction): both sides of
every parity check are compiled at the same level, and a model whose
training amplifies rounding is judged by its measured sensitivity
(`tests.parity.adam_steps_sensitivity`).

`--xla_cpu_use_fusion_emitters=false` has XLA:CPU emit its fusions with its
elemental emitters instead of the newer fusion emitters, which also wrap
every unfused instruction in a fusion of its own. It halves compiling again
(the whole suite's compile seconds, 880 -> 473; a Qwen3.5 train step,
6.4 s -> under 3 s) and changes neither the HLO passes' collectives nor a
program's argument, output and aliased bytes; the wrapped fusions move the
memory scheduler's ties, so temporary bytes may differ by a little
(`tests/report/test_compiled_report.py`: GPT-2 128 bytes; over the zoo's train
steps the most was +2.7 %, the Llama's free plan on 2x4). XLA:GPU ignores
it. BENCHMARKS.md's memory-truth figures are compiled with XLA's defaults.

The user-experience tests (`tests/test_readme.py`, `tests/test_wheel.py`,
`tests/cli/test_cli_target.py`, `tests/runtime/test_devices.py`) run subprocesses with
XLA's defaults, as a user's shell has them.
"""

import os

SUITE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)


def with_suite_flags(flags: str) -> str:
    """`flags` (an `XLA_FLAGS` value) with the suite's code generation,
    each flag unless `flags` sets its own."""
    own = [flag for flag in SUITE_XLA_FLAGS.split() if flag.split("=")[0] not in flags]
    return " ".join([flags, *own]).strip()


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a subprocess that sets its own device
    count: `XLA_FLAGS` holds the suite's flags alone (not this process's
    simulated devices), then `overrides`."""
    env = dict(os.environ, XLA_FLAGS=SUITE_XLA_FLAGS)
    env.update(overrides)
    return env
