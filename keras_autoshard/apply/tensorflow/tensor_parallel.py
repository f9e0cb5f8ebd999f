"""`TensorParallel(...)` under the TensorFlow backend: data parallelism only.

With `world_size=1` the model is replicated on every chosen device and each
batch is split over them by `tf.distribute.MirroredStrategy`; any larger
`world_size` (tensor parallelism) raises `TensorFlowModelParallelError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras

from keras_autoshard.apply.first_batch import first_batch
from keras_autoshard.apply.tensor_parallel import TensorParallel
from keras_autoshard.apply.tensor_parallel_setup import (
    DATA_AXIS,
    MODEL_AXIS,
    TensorParallelError,
    select_devices,
)
from keras_autoshard.apply.tensorflow.data_parallel import (
    ALTERNATIVES,
    WHY,
    TensorFlowModelParallelError,
    check_data_parallel_plan,
    cuts_asked,
    data_parallel_strategy,
)
from keras_autoshard.compat import keras_private
from keras_autoshard.plans.rules import Spec
from keras_autoshard.plans.sharding_plan import MeshSpec, PlanError, ShardingPlan
from keras_autoshard.plans.units import optional_byte_size

logger = logging.getLogger(__name__)


@keras.saving.register_keras_serializable(package="keras_autoshard")
class TensorFlowTensorParallel(TensorParallel):
    """The TensorFlow side of `keras_autoshard.TensorParallel`: data parallel.

    `keras_autoshard.TensorParallel(model, world_size=1)` returns one of these
    when Keras runs on TensorFlow. The model is replicated on each device of a
    `tf.distribute.MirroredStrategy`; every batch is split over the replicas
    and the gradients summed, so training matches one device on the whole
    batch. The plan (every variable replicated) is made on the first batch in
    a JAX subprocess, as under JAX, and checked.

    Args:
        model: A function with no arguments that builds the model (it is then
            built inside the strategy's scope, as `tf.distribute` requires), a
            serialized model config, or a `keras.Model`. A model whose
            variables were made outside the scope is rebuilt inside it from
            its config and given its weights: train the wrapper (or
            `wrapped_model`), not the original object.
        world_size: Must be 1 (or `None` with one device): devices per model
            copy. Larger values are tensor parallelism, which the TensorFlow
            backend refuses.
        device_ids: Devices to replicate over (`"cpu:0"`, `"gpu:1"` or
            indices); all by default.
        distributed_backend: `"tensorflow"` or `"auto"` (what
            `TensorParallel` dispatched on).
        sample_input: One global batch to plan with now.
        memory_budget: Per-device bytes (a number, or a string such as
            `"16GiB"`) for parameters and optimizer state;
            a budget that only a cut variable would meet is refused.
        rules: Variable path regex → spec, for the planner.
        **kwargs: Passed to `keras.Model` (`name`, ...).

    Raises:
        TensorFlowModelParallelError: `world_size` larger than 1.

    Example:

    ```python
    # KERAS_BACKEND=tensorflow
    model = keras_autoshard.TensorParallel(build_model, world_size=1)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64)   # 64 rows split over every device
    ```
    """

    def __init__(
        self,
        model: keras.Model | Callable[[], keras.Model] | Mapping[str, Any],
        world_size: int | None = None,
        device_ids: Sequence[str | int] | None = None,
        distributed_backend: str = "tensorflow",
        sample_input=None,
        memory_budget: int | str | None = None,
        rules: Mapping[str, Spec] | None = None,
        **kwargs,
    ):
        devices = select_devices(device_ids)
        world_size = len(devices) if world_size is None else world_size
        if world_size != 1:
            raise TensorFlowModelParallelError(
                f"TensorParallel(world_size={world_size}) on the TensorFlow "
                f"backend asks for tensor parallelism over {world_size} devices, "
                f"but {WHY}. {ALTERNATIVES}"
            )
        self.mesh = MeshSpec((len(devices), 1), (DATA_AXIS, MODEL_AXIS))
        self.device_ids = devices
        self.world_size = 1
        self.strategy = data_parallel_strategy(devices)
        kwargs.setdefault("name", "tensor_parallel")
        # Keras's TensorFlow trainer takes the strategy current at __init__.
        with self.strategy.scope():
            super().__init__(**kwargs)
            self.wrapped_model = self._materialize(model)
        self._memory_budget = optional_byte_size(memory_budget)
        self._rules = None if rules is None else dict(rules)
        self._plan: ShardingPlan | None = None
        if self.wrapped_model.built:
            self.built = True
        if sample_input is not None:
            self.prepare(sample_input)

    @property
    def is_planned(self) -> bool:
        return self._plan is not None

    @property
    def plan(self) -> ShardingPlan:
        """The checked plan (after the first batch or `prepare`)."""
        if self._plan is None:
            raise PlanError(
                "No plan yet: it is made on the first batch or by prepare(x)."
            )
        return self._plan

    def prepare(self, sample_input) -> ShardingPlan:
        """Plan for batches like `sample_input` and check the plan is replicated.

        Args:
            sample_input: One global batch of inputs.

        Returns:
            The `ShardingPlan` (mesh `(devices, 1)`, every variable whole).

        Raises:
            TensorFlowModelParallelError: the plan cuts a variable.
        """
        from keras_autoshard.apply.tensorflow.planning import plan_for_tensorflow

        if self._plan is None:
            if not self.wrapped_model.built:
                with self.strategy.scope():
                    self.wrapped_model(sample_input)
            plan = plan_for_tensorflow(
                self.wrapped_model,
                self.mesh,
                sample_input,
                memory_budget=self._memory_budget,
                rules=self._rules,
            )
            check_data_parallel_plan(
                plan, cuts_required=cuts_asked(self._memory_budget, self._rules)
            )
            self._plan = plan
            self.built = True
        return self._plan

    def _prepare_from(self, x, y=None, sample_weight=None, batch_size=None) -> None:
        if self._plan is not None:
            return
        inputs, _, _ = keras.utils.unpack_x_y_sample_weight(
            first_batch(x, y, sample_weight, batch_size)
        )
        self.prepare(inputs)

    def _materialize(self, model) -> keras.Model:
        if isinstance(model, Mapping):
            config = dict(model)
            built = keras.saving.deserialize_keras_object(config)
        elif isinstance(model, keras.Model):
            built = model
            outside = [
                v.path
                for v in model.variables
                if not self.strategy.extended.variable_created_in_scope(v.value)
            ]
            if outside:
                logger.info(
                    "Rebuilding %r inside the MirroredStrategy scope: %d variables "
                    "were made outside it.",
                    model.name,
                    len(outside),
                )
                built = _rebuilt_in_scope(model)
        elif callable(model):
            built = model()
        else:
            raise TensorParallelError(
                f"TensorParallel takes a keras.Model, a function that builds one "
                f"or a model config dict; got {type(model).__name__}."
            )
        if not isinstance(built, keras.Model):
            raise TensorParallelError(
                f"The model builder returned {type(built).__name__}, not a keras.Model."
            )
        return built

    def call(self, inputs, training=None):
        return self.wrapped_model(inputs, training=training)

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        with self.strategy.scope():
            super().compile(self._optimizer_in_scope(optimizer), *args, **kwargs)

    def _optimizer_in_scope(self, optimizer):
        """`optimizer`, remade inside the strategy's scope if made outside it
        (a TensorFlow optimizer keeps the strategy current at its creation)."""
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            return optimizer
        if keras_private.optimizer_distribution_strategy(optimizer) is self.strategy:
            return optimizer
        if optimizer.built:
            raise TensorParallelError(
                f"Optimizer {optimizer.name!r} was built outside the "
                "MirroredStrategy scope, so its variables cannot be mirrored. "
                "Pass a new optimizer (or its name) to compile()."
            )
        return type(optimizer).from_config(optimizer.get_config())

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._prepare_from(x, y, kwargs.get("sample_weight"), batch_size)
        return super().fit(x, y, batch_size, *args, **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._prepare_from(x, y, kwargs.get("sample_weight"), batch_size)
        return super().evaluate(x, y, batch_size, *args, **kwargs)

    def predict(self, x, batch_size=None, *args, **kwargs):
        self._prepare_from(x, batch_size=batch_size)
        return super().predict(x, batch_size, *args, **kwargs)

    def train_on_batch(self, x, y=None, *args, **kwargs):
        self.prepare(x)
        return super().train_on_batch(x, y, *args, **kwargs)

    def test_on_batch(self, x, y=None, *args, **kwargs):
        self.prepare(x)
        return super().test_on_batch(x, y, *args, **kwargs)

    def predict_on_batch(self, x):
        self.prepare(x)
        return super().predict_on_batch(x)

    def save_weights(self, filepath, *args, **kwargs):
        """Save the wrapped model's weights (loadable without the wrapper)."""
        return self.wrapped_model.save_weights(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """Load weights saved by the wrapped (or an identical) model."""
        return self.wrapped_model.load_weights(filepath, *args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"<TensorParallel (TensorFlow, MirroredStrategy) "
            f"{self.wrapped_model.name!r} mesh={self.mesh.describe()}>"
        )


def _rebuilt_in_scope(model: keras.Model) -> keras.Model:
    """`model` made again from its config (in the current scope), same weights."""
    try:
        rebuilt = keras.saving.deserialize_keras_object(
            keras.saving.serialize_keras_object(model)
        )
    except Exception as error:  # noqa: BLE001 - any failure means "not rebuildable"
        raise TensorParallelError(
            f"Model {model.name!r} was built outside the MirroredStrategy scope "
            f"and cannot be rebuilt from its config ({type(error).__name__}: "
            f"{error}). Pass a function that builds it instead: "
            "TensorParallel(lambda: build_model(), world_size=1)."
        ) from error
    rebuilt.set_weights(model.get_weights())
    return rebuilt
