"""The suite compiles with `tests/fast_codegen.FLAG` (XLA's machine-code
generation at its lowest optimization level): the programs it reads are the
ones XLA makes at its default level. A planned 2x4 train step is compiled
in a fresh process with the flag and in one without it, for XLA:CPU (the
simulated devices) and for 8 H100s deviceless (XLA:GPU); the optimized HLO,
with its collectives, and the compiled memory analysis must be the same."""

import json
import os
import subprocess
import sys

import pytest

from tests import fast_codegen

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Prints the optimized HLO's digest and the memory analysis of one planned
# train step on each compiler, as JSON.
PROGRAMS = """
import hashlib, json, sys
from keras_autoshard.runtime.devices import simulate_devices
simulate_devices(8)
import jax, keras, numpy as np
import keras_autoshard as ka
from keras_autoshard.apply.jax.target_compile import compile_for_target
from keras_autoshard.report.compiled_program import inspect_compiled


def build():
    inputs = keras.Input((256,))
    hidden = keras.layers.Dense(1024, activation="gelu", name="up")(inputs)
    return keras.Model(inputs, keras.layers.Dense(256, name="down")(hidden))


x = np.ones((64, 256), "float32")
plan = ka.plan(build, ka.MeshSpec((2, 4), ("batch", "model")), x)
distribution = ka.PlanDistribution(plan)
with distribution.scope():
    model = build()
    model.compile(optimizer="adam", loss="mse")
cpu = inspect_compiled(model, distribution, (x, x)).train_step
struct = jax.ShapeDtypeStruct(x.shape, x.dtype)
gpu = compile_for_target(build, plan, (struct, struct), "h100-80gb").step
print(json.dumps({
    name: [hashlib.sha1(step.hlo_text.encode()).hexdigest(), step.memory]
    for name, step in (("XLA:CPU", cpu), ("XLA:GPU", gpu))
}))
"""


def _programs(xla_flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS=xla_flags, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", PROGRAMS],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_flag_changes_no_compiled_program():
    assert fast_codegen.FLAG in os.environ["XLA_FLAGS"].split()
    default = _programs("")
    fast = _programs(fast_codegen.FLAG)
    assert set(default) == {"XLA:CPU", "XLA:GPU"}
    for compiler, (digest, memory) in default.items():
        assert fast[compiler][0] == digest, f"{compiler}: optimized HLO differs"
        assert fast[compiler][1] == memory, (compiler, fast[compiler][1], memory)
        assert memory["temp_bytes"] > 0, (compiler, memory)


def test_the_flag_is_added_once():
    once = fast_codegen.with_flag("--xla_force_host_platform_device_count=8")
    count = "--xla_force_host_platform_device_count=8"
    assert once.split() == [count, fast_codegen.FLAG]
    assert fast_codegen.with_flag(once) == once
    assert fast_codegen.subprocess_env()["XLA_FLAGS"] == fast_codegen.FLAG
