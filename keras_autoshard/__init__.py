"""keras-autoshard: shard any Keras 3 model over many devices.

The public API is named here, in the style of `keras.distribution`:

- planning: `plan`, `plan_from_rules`, `ShardingPlan`, `MeshSpec`,
  `HardwareProfile`, `hardware_profile`, `AutoShardDistribution`,
  `PlanDistribution`, `TensorParallel`, `rematerialize`, and the devices
  `simulate_devices`, `make_device_mesh`;
- loading and saving: `load_weights_sharded` (a weights file),
  `from_preset` (a KerasHub preset), `save_checkpoint`,
  `restore_checkpoint`, `load_model_sharded`, the callback
  `ShardedCheckpoint` (either backend; `ShardedCheckpoint.complete_steps`
  lists the steps whose save finished) and `save_safetensors`;
- reports: `inspect_compiled`, `compile_for_target`;
- modules of the API: `keras_autoshard.distributed` (the processes of a
  job: `initialize`, `resolve_cluster`, `process_batch_rows`, and the
  collectives `all_reduce`, `all_gather`, ... for hand-written parallel
  code), `keras_autoshard.building` (`build_abstract`: a model built with no
  weights; `names_replayed_after`: a model built again gets the same
  variable paths), `keras_autoshard.errors` (every error, under
  `AutoShardError`) and `keras_autoshard.types` (the data the API returns:
  `PlanEstimate`, `VariableSharding`, `CompiledReport`, ...).

Every other module is internal and may move. Names the top level held
before keep working for one release, with a `DeprecationWarning` naming
where they live now (`_MOVED`).

Names are imported lazily, so `import keras_autoshard` neither imports Keras
nor fixes its backend: `simulate_devices` and the command line can still set
`KERAS_BACKEND` and `XLA_FLAGS` first. `keras_autoshard.collectives` (now
`keras_autoshard.distributed`) keeps working one release, warning likewise.
"""

import importlib
import warnings

_PUBLIC_NAMES = {
    "MeshSpec": "keras_autoshard.plans.sharding_plan",
    "ShardingPlan": "keras_autoshard.plans.sharding_plan",
    "HardwareProfile": "keras_autoshard.plans.hardware",
    "hardware_profile": "keras_autoshard.plans.hardware",
    "plan_from_rules": "keras_autoshard.plans.rules",
    "PlanDistribution": "keras_autoshard.apply.jax.plan_distribution",
    "rematerialize": "keras_autoshard.apply.remat",
    "make_device_mesh": "keras_autoshard.apply.jax.device_mesh",
    "simulate_devices": "keras_autoshard.runtime.devices",
    "inspect_compiled": "keras_autoshard.report.compiled_program",
    "compile_for_target": "keras_autoshard.apply.jax.target_compile",
    "AutoShardDistribution": "keras_autoshard.apply.auto_distribution",
    "plan": "keras_autoshard.planner.planner",
    "load_weights_sharded": "keras_autoshard.checkpoint.sharded_load",
    "from_preset": "keras_autoshard.checkpoint.sharded_load",
    "save_checkpoint": "keras_autoshard.checkpoint.orbax_save",
    "restore_checkpoint": "keras_autoshard.checkpoint.orbax_restore",
    "load_model_sharded": "keras_autoshard.checkpoint.orbax_restore",
    "ShardedCheckpoint": "keras_autoshard.checkpoint.callback",
    "save_safetensors": "keras_autoshard.checkpoint.safetensors_save",
    "TensorParallel": "keras_autoshard.apply.tensor_parallel",
}

# Submodules that are part of the API: `keras_autoshard.errors.PlanError`.
_SUBMODULES = ("building", "distributed", "errors", "types")

# Old top-level name -> (module that defines it, its spelling now).
_MOVED = {
    **{
        name: ("keras_autoshard.errors", f"keras_autoshard.errors.{name}")
        for name in (
            "AutoShardError",
            "BatchSizeError",
            "CheckpointError",
            "ClusterError",
            "DeviceSetupError",
            "ModelNotTraceableError",
            "PlanError",
            "TensorParallelError",
        )
    },
    **{
        name: ("keras_autoshard.types", f"keras_autoshard.types.{name}")
        for name in (
            "ActivationLayout",
            "ClusterSpec",
            "CompiledReport",
            "LoadReport",
            "PlanEstimate",
            "RestoredCheckpoint",
            "TargetCompile",
            "VariableSharding",
        )
    },
    "ShardedOrbaxCheckpoint": (
        "keras_autoshard.checkpoint.orbax_callback",
        "keras_autoshard.ShardedCheckpoint (it picks Orbax on JAX)",
    ),
    "ShardedTorchCheckpoint": (
        "keras_autoshard.checkpoint.torch_callback",
        "keras_autoshard.ShardedCheckpoint (it picks torch.distributed.checkpoint "
        "on PyTorch)",
    ),
    "build_abstract": (
        "keras_autoshard.trace.tracer",
        "keras_autoshard.building.build_abstract",
    ),
    "names_replayed_after": (
        "keras_autoshard.trace.naming",
        "keras_autoshard.building.names_replayed_after",
    ),
    "initialize": (
        "keras_autoshard.runtime.cluster",
        "keras_autoshard.distributed.initialize",
    ),
    "resolve_cluster": (
        "keras_autoshard.runtime.cluster",
        "keras_autoshard.distributed.resolve_cluster",
    ),
    "process_batch_rows": (
        "keras_autoshard.runtime.cluster",
        "keras_autoshard.distributed.process_batch_rows",
    ),
    "complete_steps": (
        "keras_autoshard.checkpoint.steps",
        "keras_autoshard.ShardedCheckpoint.complete_steps",
    ),
    "load_preset_sharded": (
        "keras_autoshard.checkpoint.sharded_load",
        "keras_autoshard.from_preset(keras_hub.models.Backbone, preset_dir, "
        "distribution)",
    ),
}

__all__ = sorted([*_PUBLIC_NAMES, *_SUBMODULES])
__version__ = "0.1.0"


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"keras_autoshard.{name}")
    module_name = _PUBLIC_NAMES.get(name)
    if module_name is not None:
        value = getattr(importlib.import_module(module_name), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        module_name, now = _MOVED[name]
        warnings.warn(
            f"keras_autoshard.{name} is deprecated and leaves the top level in "
            f"the next release: use {now}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module_name), name)
    raise AttributeError(f"module 'keras_autoshard' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC_NAMES) | set(_SUBMODULES))
