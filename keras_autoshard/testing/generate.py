"""A KerasHub CausalLM's `generate_step`, planned and compiled.

The generate job's estimate (its key/value cache, its peak) is checked
against XLA's compile of the zoo backbones' CausalLM `generate_step`, built
around the plan as KerasHub's JAX `generate` jits it.
"""

from __future__ import annotations

import itertools
import math
import re

import keras

from keras_autoshard import plan
from keras_autoshard.plans.sharding_plan import MeshSpec
from keras_autoshard.testing import zoo
from keras_autoshard.testing.compiled import plan_distribution
from keras_autoshard.trace.naming import names_replayed_after
from keras_autoshard.trace.tracer import build_abstract

# The KerasHub task that generates with each zoo backbone.
CAUSAL_LM = {
    "gpt2": "GPT2CausalLM",
    "opt": "OPTCausalLM",
    "gemma": "GemmaCausalLM",
    "llama": "LlamaCausalLM",
}


def compiled_generate_step(task, distribution, x):
    """Compile `task.generate_step` on the token batch `x` as KerasHub's JAX
    `generate` jits it (variables passed as state through a
    `StatelessScope`, the batch laid out by `distribution`), without
    running it."""
    import jax

    def generate(inputs, state):
        mapping = itertools.chain(
            zip(task.trainable_variables, state[0]),
            zip(task.non_trainable_variables, state[1]),
        )
        with keras.StatelessScope(state_mapping=mapping):
            return task.generate_step(inputs, None)

    state = (
        [v.value for v in task.trainable_variables],
        [v.value for v in task.non_trainable_variables],
    )
    inputs = {
        name: jax.device_put(
            value, distribution.get_data_layout(value.shape).backend_layout
        )
        for name, value in x.items()
    }
    return jax.jit(generate).lower(inputs, state).compile()


def executable_peak_bytes(compiled) -> int:
    """What a compiled executable needs at its peak per device, from XLA's
    memory analysis: arguments + outputs + temporaries − aliased."""
    memory = compiled.memory_analysis()
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )


# A float32 generation cache of the zoo's batches in optimized HLO:
# (batch, layers, key and value, tokens = 64, heads, head dim).
_CACHE_BUFFER = re.compile(r"f32\[(\d+),(\d+),2,64,(\d+),(\d+)\]")


def cache_buffer_bytes(hlo_text: str) -> set[int]:
    """Bytes per device of each distinct buffer of the whole cache (every
    layer; a decode step's one-layer slices are left out) in an optimized
    HLO (empty when there is none)."""
    shapes = [tuple(int(d) for d in dims) for dims in _CACHE_BUFFER.findall(hlo_text)]
    layers = max((shape[1] for shape in shapes), default=0)
    return {4 * math.prod(shape) * 2 * 64 for shape in shapes if shape[1] == layers}


def planned_generate(name: str, shape: tuple[int, ...]):
    """Plan the zoo backbone `name`'s KerasHub CausalLM for `job="generate"`
    on a (batch, model) mesh of `shape` (the task built around an abstract
    backbone), then compile its `generate_step` as planned on the zoo's
    token batch; `(plan, compiled)`."""
    import keras_hub

    task_class = getattr(keras_hub.models, CAUSAL_LM[name])
    build = getattr(zoo, name)
    x = zoo.token_inputs(1024)
    abstract = task_class(backbone=build_abstract(build), preprocessor=None)
    sharding_plan = plan(
        abstract, MeshSpec(shape, ("batch", "model")), x, job="generate"
    )
    distribution = plan_distribution(sharding_plan)
    with distribution.scope(), names_replayed_after():
        task = task_class(backbone=build(), preprocessor=None)
        task.compile(sampler="greedy")
        compiled = compiled_generate_step(task, distribution, x)
    return sharding_plan, compiled
