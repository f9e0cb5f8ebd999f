"""Trigger real keras-autoshard errors and print their messages.

`docs/troubleshooting.md` quotes these messages word for word; each quote
there is introduced by `<!-- error: ID from: MODULE -->`. For the IDs below,
`tests/test_docs.py` triggers the error again and checks that the quote is
exactly what the library prints; every other quote is checked against the
message templates (f-strings) of the module it names.

    python -m tools.error_messages            # every message, by ID
    python -m tools.error_messages rule-matches-nothing

Each trigger is cheap: no model is trained, at most a two-layer model is
planned. They expect Keras on JAX with 8 (simulated) devices, as the tests run.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import types
from collections.abc import Callable

from tools import python_source

PLACEHOLDER = "{…}"


def _variables(*entries: tuple[str, tuple[int, ...]]) -> list[types.SimpleNamespace]:
    """Stand-ins for Keras variables: what plans read (path, shape, dtype)."""
    return [
        types.SimpleNamespace(path=path, shape=shape, dtype="float32", trainable=True)
        for path, shape in entries
    ]


def _mlp_variables() -> list[types.SimpleNamespace]:
    return _variables(
        ("dense/kernel", (64, 256)),
        ("dense/bias", (256,)),
        ("dense_1/kernel", (256, 10)),
        ("dense_1/bias", (10,)),
    )


def _mesh():
    from keras_autoshard import MeshSpec

    return MeshSpec((2, 4), ("batch", "model"))


def rule_matches_nothing() -> None:
    from keras_autoshard import plan_from_rules

    plan_from_rules(
        _mlp_variables(), _mesh(), {r".*kernal": (None, "model")}, batch_axis="batch"
    )


def rule_matches_twice() -> None:
    from keras_autoshard import plan_from_rules

    rules = {r".*kernel": (None, "model"), r"dense/.*": (None, "model")}
    plan_from_rules(_mlp_variables(), _mesh(), rules, batch_axis="batch")


def dim_not_divisible() -> None:
    from keras_autoshard import plan_from_rules

    plan_from_rules(
        _mlp_variables(),
        _mesh(),
        {r"dense_1/kernel": (None, "model")},
        batch_axis="batch",
    )


def variable_not_in_plan() -> None:
    from keras_autoshard import plan_from_rules

    plan = plan_from_rules(_mlp_variables()[:3], _mesh(), {}, batch_axis="batch")
    plan.validate(types.SimpleNamespace(variables=_mlp_variables()))


def plan_shape_mismatch() -> None:
    from keras_autoshard import plan_from_rules

    plan = plan_from_rules(_mlp_variables(), _mesh(), {}, batch_axis="batch")
    wider = _variables(
        ("dense/kernel", (64, 512)),
        ("dense/bias", (256,)),
        ("dense_1/kernel", (256, 10)),
        ("dense_1/bias", (10,)),
    )
    plan.validate(types.SimpleNamespace(variables=wider))


def not_a_plan() -> None:
    from keras_autoshard import ShardingPlan

    ShardingPlan.from_json('{"format": "keras/layout-map"}')


def mesh_names_mismatch() -> None:
    from keras_autoshard import MeshSpec

    MeshSpec((2, 4), ("model",))


def mesh_device_count() -> None:
    from keras_autoshard import MeshSpec, make_device_mesh

    make_device_mesh(MeshSpec((2, 2), ("batch", "model")))


def plan_for_other_mesh() -> None:
    from keras_autoshard import (
        MeshSpec,
        PlanDistribution,
        make_device_mesh,
        plan_from_rules,
    )

    plan = plan_from_rules(_mlp_variables(), _mesh(), {}, batch_axis="batch")
    PlanDistribution(plan, make_device_mesh(MeshSpec((1, 8), ("batch", "model"))))


def batch_not_divisible() -> None:
    from keras_autoshard import PlanDistribution, plan_from_rules

    plan = plan_from_rules(_mlp_variables(), _mesh(), {}, batch_axis="batch")
    PlanDistribution(plan).get_data_layout((5, 64))


def trainable_variable_not_in_plan() -> None:
    import keras

    from keras_autoshard import PlanDistribution, plan_from_rules

    plan = plan_from_rules(_mlp_variables(), _mesh(), {}, batch_axis="batch")
    distribution = PlanDistribution(plan)
    with distribution.scope():
        keras.layers.Dense(8, name="head").build((None, 10))


def no_plan_yet() -> None:
    from keras_autoshard import AutoShardDistribution

    return AutoShardDistribution(_mesh()).plan


def plan_needs_sample_input() -> None:
    import keras

    from keras_autoshard import plan

    plan(keras.Sequential([keras.Input((64,)), keras.layers.Dense(256)]), _mesh())


def no_plan_fits_budget() -> None:
    import keras

    from keras_autoshard import plan

    def build():
        return keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(64)],
            name="mlp",
        )

    plan(build, _mesh(), sample_input=keras.ops.zeros((8, 64)), memory_budget=1024)


def devices_already_started() -> None:
    import jax

    from keras_autoshard import simulate_devices

    jax.devices()
    simulate_devices(2 * jax.device_count())


def gpu_compiler_missing() -> None:
    from unittest import mock

    from keras_autoshard.runtime import gpu_targets

    # As on a machine without JAX's CUDA plugin.
    with mock.patch.object(gpu_targets.importlib.util, "find_spec", return_value=None):
        gpu_targets.require_gpu_compiler()


def collective_outside_shard_map() -> None:
    import jax.numpy as jnp

    from keras_autoshard.distributed import all_reduce

    all_reduce(jnp.ones(4), axis_name="model")


def collective_without_axis_name() -> None:
    import jax.numpy as jnp

    from keras_autoshard.distributed import all_gather

    all_gather(jnp.ones(4))


def collective_wrong_type() -> None:
    import numpy as np

    from keras_autoshard.distributed import all_reduce

    all_reduce(np.ones(4), axis_name="model")


def world_size_does_not_divide() -> None:
    from keras_autoshard import TensorParallel

    TensorParallel(lambda: None, world_size=3)


def torch_backend_under_jax() -> None:
    from keras_autoshard import TensorParallel

    TensorParallel(lambda: None, distributed_backend="torch")


def no_weights_file() -> None:
    from keras_autoshard import load_weights_sharded

    load_weights_sharded(None, "missing.weights.h5")


def no_complete_checkpoint() -> None:
    from keras_autoshard import restore_checkpoint

    restore_checkpoint(None, "missing_checkpoint_dir")


def cluster_arguments_incomplete() -> None:
    from keras_autoshard.distributed import resolve_cluster

    resolve_cluster(coordinator_address="10.0.0.1:1234", environ={})


def cluster_variables_incomplete() -> None:
    from keras_autoshard.distributed import resolve_cluster

    resolve_cluster(environ={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})


def cluster_process_id_out_of_range() -> None:
    from keras_autoshard.distributed import resolve_cluster

    resolve_cluster("10.0.0.1:1234", num_processes=2, process_id=2, environ={})


TRIGGERS: dict[str, Callable[[], object]] = {
    "rule-matches-nothing": rule_matches_nothing,
    "rule-matches-twice": rule_matches_twice,
    "dim-not-divisible": dim_not_divisible,
    "variable-not-in-plan": variable_not_in_plan,
    "plan-shape-mismatch": plan_shape_mismatch,
    "not-a-plan": not_a_plan,
    "mesh-names-mismatch": mesh_names_mismatch,
    "plan-for-other-mesh": plan_for_other_mesh,
    "mesh-device-count": mesh_device_count,
    "batch-not-divisible": batch_not_divisible,
    "trainable-variable-not-in-plan": trainable_variable_not_in_plan,
    "no-plan-yet": no_plan_yet,
    "plan-needs-sample-input": plan_needs_sample_input,
    "no-plan-fits-budget": no_plan_fits_budget,
    "devices-already-started": devices_already_started,
    "gpu-compiler-missing": gpu_compiler_missing,
    "collective-outside-shard-map": collective_outside_shard_map,
    "collective-without-axis-name": collective_without_axis_name,
    "collective-wrong-type": collective_wrong_type,
    "world-size-does-not-divide": world_size_does_not_divide,
    "torch-backend-under-jax": torch_backend_under_jax,
    "no-weights-file": no_weights_file,
    "no-complete-checkpoint": no_complete_checkpoint,
    "cluster-arguments-incomplete": cluster_arguments_incomplete,
    "cluster-variables-incomplete": cluster_variables_incomplete,
    "cluster-process-id-out-of-range": cluster_process_id_out_of_range,
}


def message_templates(module_path: str) -> list[str]:
    """Every string literal of a module, f-string fields shown as `{…}`.

    Adjacent literals are one node in Python's syntax tree, so a message split
    over several source lines comes out whole.

    Args:
        module_path: Path of a Python file, relative to the repository root.

    Returns:
        The templates, in source order.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, module_path), encoding="utf-8") as f:
        tree = python_source.parse(f.read())
    templates = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            templates.append(
                "".join(
                    part.value if isinstance(part, ast.Constant) else PLACEHOLDER
                    for part in node.values
                )
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            templates.append(node.value)
    return templates


def matches_a_template(line: str, templates: list[str]) -> bool:
    """Whether `line` is one of `templates` with its `{…}` fields filled in.

    A leading `"  - "` (the list format of multi-problem messages) is ignored,
    and templates with fewer than 20 literal characters are not used: they
    would match almost anything.
    """
    text = line.removeprefix("  - ")
    for template in templates:
        literal = template.split(PLACEHOLDER)
        if len("".join(literal)) < 20:
            continue
        pattern = ".*?".join(re.escape(part) for part in literal)
        if re.fullmatch(pattern, text, flags=re.DOTALL):
            return True
    return False


def error_message(error_id: str) -> tuple[str, str]:
    """(exception class name, message) that trigger `error_id` raises.

    Raises:
        AssertionError: the trigger raised nothing.
    """
    try:
        TRIGGERS[error_id]()
    except Exception as error:  # the point is to catch whatever it raises
        return type(error).__name__, str(error)
    raise AssertionError(f"{error_id}: the trigger raised no error")


def main(argv: list[str]) -> int:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from keras_autoshard import simulate_devices

    simulate_devices(8)
    for error_id in argv or TRIGGERS:
        name, message = error_message(error_id)
        print(f"== {error_id} ({name})\n{message}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
