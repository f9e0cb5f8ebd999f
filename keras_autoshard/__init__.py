"""keras-autoshard: shard any Keras 3 model over many devices.

The public API is named here; every other module is internal and may move.
Pipeline: model → trace (shapes only) → axis graph → plan → apply, then
reports and checkpoints read the plan.
"""

from keras_autoshard.apply.device_mesh import make_device_mesh
from keras_autoshard.apply.plan_distribution import PlanDistribution
from keras_autoshard.devices import DeviceSetupError, simulate_devices
from keras_autoshard.naming import names_replayed_after
from keras_autoshard.plan.rules import plan_from_rules
from keras_autoshard.plan.sharding_plan import (
    ActivationLayout,
    MeshSpec,
    PlanError,
    ShardingPlan,
    VariableSharding,
)


def inspect_compiled(model, distribution, sample_batch):
    """Compile one train and one forward step; report bytes and collectives.

    See `keras_autoshard.backends.jax.compiled_program.inspect_compiled`.
    """
    from keras_autoshard.backends.jax.compiled_program import (
        inspect_compiled as _inspect,
    )

    return _inspect(model, distribution, sample_batch)


__all__ = [
    "ActivationLayout",
    "DeviceSetupError",
    "MeshSpec",
    "PlanDistribution",
    "PlanError",
    "ShardingPlan",
    "VariableSharding",
    "inspect_compiled",
    "make_device_mesh",
    "names_replayed_after",
    "plan_from_rules",
    "simulate_devices",
]
__version__ = "0.1.0"
