"""keras-autoshard: shard any Keras 3 model over many devices.

The public API is named here; every other module is internal and may move.
Pipeline: model → trace (shapes only) → axis graph → plan → apply, then
reports and checkpoints read the plan.

Names are imported lazily, so `import keras_autoshard` neither imports Keras
nor fixes its backend: `simulate_devices` and the command line can still set
`KERAS_BACKEND` and `XLA_FLAGS` first.
"""

import importlib

_PUBLIC_NAMES = {
    "ActivationLayout": "keras_autoshard.plans.sharding_plan",
    "AutoShardError": "keras_autoshard.errors",
    "BatchSizeError": "keras_autoshard.errors",
    "ModelNotTraceableError": "keras_autoshard.errors",
    "MeshSpec": "keras_autoshard.plans.sharding_plan",
    "PlanError": "keras_autoshard.plans.sharding_plan",
    "ShardingPlan": "keras_autoshard.plans.sharding_plan",
    "VariableSharding": "keras_autoshard.plans.sharding_plan",
    "PlanEstimate": "keras_autoshard.plans.estimate",
    "HardwareProfile": "keras_autoshard.plans.hardware",
    "hardware_profile": "keras_autoshard.plans.hardware",
    "plan_from_rules": "keras_autoshard.plans.rules",
    "PlanDistribution": "keras_autoshard.apply.jax.plan_distribution",
    "rematerialize": "keras_autoshard.apply.remat",
    "make_device_mesh": "keras_autoshard.apply.jax.device_mesh",
    "DeviceSetupError": "keras_autoshard.runtime.devices",
    "simulate_devices": "keras_autoshard.runtime.devices",
    "names_replayed_after": "keras_autoshard.trace.naming",
    "build_abstract": "keras_autoshard.trace.tracer",
    "CompiledReport": "keras_autoshard.report.compiled_report",
    "inspect_compiled": "keras_autoshard.report.compiled_program",
    "compile_for_target": "keras_autoshard.apply.jax.target_compile",
    "TargetCompile": "keras_autoshard.apply.jax.target_compile",
    "AutoShardDistribution": "keras_autoshard.apply.auto_distribution",
    "plan": "keras_autoshard.planner.planner",
    "CheckpointError": "keras_autoshard.errors",
    "LoadReport": "keras_autoshard.checkpoint.sharded_load",
    "load_weights_sharded": "keras_autoshard.checkpoint.sharded_load",
    "load_preset_sharded": "keras_autoshard.checkpoint.sharded_load",
    "from_preset": "keras_autoshard.checkpoint.sharded_load",
    "save_checkpoint": "keras_autoshard.checkpoint.orbax_io",
    "restore_checkpoint": "keras_autoshard.checkpoint.orbax_io",
    "complete_steps": "keras_autoshard.checkpoint.steps",
    "RestoredCheckpoint": "keras_autoshard.checkpoint.orbax_io",
    "load_model_sharded": "keras_autoshard.checkpoint.orbax_io",
    "ShardedOrbaxCheckpoint": "keras_autoshard.checkpoint.orbax_callback",
    "ShardedTorchCheckpoint": "keras_autoshard.checkpoint.torch_callback",
    "save_safetensors": "keras_autoshard.checkpoint.safetensors_save",
    "TensorParallel": "keras_autoshard.apply.tensor_parallel",
    "TensorParallelError": "keras_autoshard.apply.tensor_parallel_setup",
    "initialize": "keras_autoshard.runtime.cluster",
    "resolve_cluster": "keras_autoshard.runtime.cluster",
    "ClusterSpec": "keras_autoshard.runtime.cluster",
    "ClusterError": "keras_autoshard.runtime.cluster",
    "process_batch_rows": "keras_autoshard.runtime.cluster",
}

__all__ = sorted(_PUBLIC_NAMES)
__version__ = "0.1.0"


def __getattr__(name):
    module_name = _PUBLIC_NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'keras_autoshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC_NAMES))
