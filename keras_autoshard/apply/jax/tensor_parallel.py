"""`TensorParallel`: a Keras model that runs another one cut over devices.

The wrapper holds the model and an `AutoShardDistribution` over a
`(data, model)` mesh. The first batch (or `prepare(sample_input)`) plans the
sharding from the model's graph (Megatron column/row pairs over the `"model"`
axis where they pay) and moves every variable onto its planned layout shard by
shard; `compile`, `fit`, `evaluate`, `predict` and the `*_on_batch` methods run
inside the distribution's scope, so XLA's SPMD partitioner compiles sharded
steps and inserts the all-reduces that tensor parallelism needs.

The wrapped model is held by composition and built outside the wrapper's name
scope, so its variables keep the paths they have unwrapped: plans, rules and
weight files are the same with and without the wrapper.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import keras
from keras.distribution import TensorLayout

from keras_autoshard.apply.first_batch import first_batch
from keras_autoshard.apply.jax.auto_distribution import (
    JaxAutoShardDistribution,
    move_variable,
    relayout_model,
    symbolic_inputs,
)
from keras_autoshard.apply.jax.device_mesh import make_device_mesh
from keras_autoshard.apply.jax.plan_distribution import PlanDistribution
from keras_autoshard.apply.tensor_parallel import ModelSource, TensorParallel
from keras_autoshard.apply.tensor_parallel_setup import (
    TensorParallelError,
    TensorParallelSetup,
    tensor_parallel_setup,
)
from keras_autoshard.compat import keras_private, keras_variables
from keras_autoshard.plans.rules import Spec
from keras_autoshard.plans.sharding_plan import ShardingPlan
from keras_autoshard.trace.tracer import tracing_error_in

logger = logging.getLogger(__name__)


@keras.saving.register_keras_serializable(package="keras_autoshard")
class JaxTensorParallel(TensorParallel):
    """The JAX side of `keras_autoshard.TensorParallel`: an `AutoShardDistribution`
    over a `(data, model)` mesh; XLA inserts the collectives."""

    def __init__(
        self,
        model: ModelSource,
        world_size: int | None = None,
        device_ids: Sequence[str | int] | None = None,
        distributed_backend: str = "auto",
        sample_input=None,
        memory_budget: int | str | None = None,
        rules: Mapping[str, Spec] | None = None,
        **kwargs,
    ):
        setup = tensor_parallel_setup(world_size, device_ids, distributed_backend)
        if isinstance(model, TensorParallel):
            raise TensorParallelError(
                f"Model {model.name!r} is already a TensorParallel model; wrap "
                "the original model once, with the world_size you want."
            )
        kwargs.setdefault("name", "tensor_parallel")
        super().__init__(**kwargs)
        self._setup = setup
        self._arguments = {
            "world_size": world_size,
            "device_ids": None if device_ids is None else list(device_ids),
            "distributed_backend": distributed_backend,
            "memory_budget": memory_budget,
            "rules": None if rules is None else dict(rules),
        }
        self._distribution = JaxAutoShardDistribution(
            device_mesh=make_device_mesh(setup.mesh, list(setup.devices)),
            memory_budget=memory_budget,
            rules=rules,
        )
        # Each model copy is cut over `world_size` devices, as asked: the
        # batch goes over the other devices only, never the model axis.
        self._distribution._batch_over_model_axes = False
        self.wrapped_model = self._materialize(model)
        if self.wrapped_model.built:
            self.built = True
        if sample_input is not None:
            self.prepare(sample_input)

    # ------------------------------------------------------------ properties
    @property
    def distribution(self) -> JaxAutoShardDistribution:
        """The Keras distribution the model runs under."""
        return self._distribution

    @property
    def setup(self) -> TensorParallelSetup:
        """Backend, devices and mesh in use."""
        return self._setup

    @property
    def world_size(self) -> int:
        """Devices each model copy is cut over (the `"model"` axis size)."""
        return self._setup.world_size

    @property
    def device_ids(self) -> tuple[str, ...]:
        """The devices in use, in mesh order."""
        return self._setup.devices

    @property
    def is_planned(self) -> bool:
        """Whether the sharding has been planned and applied."""
        return self._distribution.is_planned

    @property
    def plan(self) -> ShardingPlan:
        """The applied `ShardingPlan` (after the first batch or `prepare`)."""
        return self._distribution.plan

    # -------------------------------------------------------------- planning
    def prepare(self, sample_input) -> ShardingPlan:
        """Plan the sharding for batches like `sample_input` and apply it.

        Builds the wrapped model if needed, traces it over shapes only, plans,
        and moves every model and optimizer variable onto its planned layout
        (device to device; no full copy is assembled).

        Args:
            sample_input: One global batch of inputs (arrays or a dict).

        Returns:
            The applied `ShardingPlan`.

        Raises:
            TensorParallelError: the model's forward pass cannot be traced
                (JAX's tracing errors); any other error of the model's call
                (a shape error, a bad argument) propagates as it was raised.
        """
        try:
            self._build_wrapped(sample_input)
            return self._distribution.prepare(self, sample_input)
        except Exception as error:
            cause = tracing_error_in(error)
            if cause is None:
                raise
            raise TensorParallelError(
                f"Cannot trace model {self.wrapped_model.name!r} to plan its "
                f"sharding ({type(cause).__name__}: {_first_line(cause)}). "
                "TensorParallel reads the forward pass with JAX tracing, so "
                "call() must work on abstract tensors: no float()/numpy() of a "
                "tensor value and no Python `if` on one (use keras.ops.cond or "
                "keras.ops.where). Check that the unwrapped model trains with "
                "model.compile(jit_compile=True)."
            ) from error

    def _build_wrapped(self, sample_input) -> None:
        # Build outside this wrapper's name scope: variable paths stay those
        # of the unwrapped model.
        if not self.wrapped_model.built:
            symbolic = symbolic_inputs(sample_input)
            with self._distribution.scope():
                keras_private.compute_output_spec(self.wrapped_model, symbolic)
        self.built = True

    def _prepare_from(self, x, y=None, sample_weight=None, batch_size=None) -> None:
        if self._distribution.is_planned:
            return
        batch = first_batch(x, y, sample_weight, batch_size)
        inputs, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
        self.prepare(inputs)

    def _materialize(self, model: ModelSource) -> keras.Model:
        if isinstance(model, keras.Model):
            return model
        if isinstance(model, Mapping):
            config = dict(model)

            def builder():
                return keras.saving.deserialize_keras_object(config)

        elif callable(model):
            builder = model
        else:
            raise TensorParallelError(
                f"TensorParallel takes a keras.Model, a function that builds one "
                f"or a model config dict; got {type(model).__name__}."
            )
        # Variables created here take a sharded layout at creation.
        with self._distribution.scope():
            built = builder()
        if not isinstance(built, keras.Model):
            raise TensorParallelError(
                f"The model builder returned {type(built).__name__}, not a keras.Model."
            )
        return built

    # ------------------------------------------------------------ the model
    def call(self, inputs, training=None):
        return self.wrapped_model(inputs, training=training)

    def compile(self, *args, **kwargs):
        with self._distribution.scope():
            super().compile(*args, **kwargs)
        self._place_optimizer_variables()

    def compile_from_config(self, config):
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            # Loading restores the optimizer's variables: create them now,
            # under the distribution so each slot takes its parameter's layout.
            with self._distribution.scope():
                self.optimizer.build(self.trainable_variables)

    def _place_optimizer_variables(self) -> None:
        """Put optimizer variables made outside the distribution (an
        optimizer instance created before `compile`) onto the mesh."""
        optimizer = self.optimizer
        if optimizer is None:
            return
        if self.is_planned and optimizer.built:
            plan_distribution = PlanDistribution(
                self.plan, self._distribution.device_mesh
            )
            relayout_model(self, plan_distribution)
            return
        mesh = self._distribution.device_mesh
        for variable in optimizer.variables:
            if keras_variables.variable_layout(variable) is None:
                move_variable(
                    variable, TensorLayout([None] * len(variable.shape), mesh)
                )

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._prepare_from(x, y, kwargs.get("sample_weight"), batch_size)
        with self._distribution.scope():
            return super().fit(x, y, batch_size, *args, **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._prepare_from(x, y, kwargs.get("sample_weight"), batch_size)
        with self._distribution.scope():
            return super().evaluate(x, y, batch_size, *args, **kwargs)

    def predict(self, x, batch_size=None, *args, **kwargs):
        self._prepare_from(x, batch_size=batch_size)
        with self._distribution.scope():
            return super().predict(x, batch_size, *args, **kwargs)

    def train_on_batch(self, x, y=None, *args, **kwargs):
        if not self._distribution.is_planned:
            self.prepare(x)
        with self._distribution.scope():
            return super().train_on_batch(x, y, *args, **kwargs)

    def test_on_batch(self, x, y=None, *args, **kwargs):
        if not self._distribution.is_planned:
            self.prepare(x)
        with self._distribution.scope():
            return super().test_on_batch(x, y, *args, **kwargs)

    def predict_on_batch(self, x):
        if not self._distribution.is_planned:
            self.prepare(x)
        with self._distribution.scope():
            return super().predict_on_batch(x)

    def save_weights(self, filepath, *args, **kwargs):
        """Save the wrapped model's weights: the file loads with or without
        the wrapper (`keras.Model.load_weights` on the unwrapped model)."""
        return self.wrapped_model.save_weights(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """Load weights saved by the wrapped (or an identical) model; each
        value is placed straight onto its variable's sharded layout."""
        return self.wrapped_model.load_weights(filepath, *args, **kwargs)

    def inspect(self, sample_batch):
        """Compile one train and one forward step and report what XLA made.

        Args:
            sample_batch: `(x, y)` with one global batch; the model must be
                compiled.

        Returns:
            A `CompiledReport` (per-device parameter and optimizer bytes,
            collectives by mesh axis). A plan that rematerializes is
            compiled scheduled for memory on XLA:CPU
            (`compiler_options_for`), whose defaults would merge the
            recomputation away.
        """
        from keras_autoshard.apply.as_planned import compiler_options_for
        from keras_autoshard.report.compiled_program import inspect_compiled

        if not self._distribution.is_planned:
            self.prepare(sample_batch[0])
        return inspect_compiled(
            self,
            self._distribution,
            sample_batch,
            compiler_options=compiler_options_for(self.plan),
        )

    # --------------------------------------------------------- serialization
    def get_config(self) -> dict[str, Any]:
        return {
            "model": keras.saving.serialize_keras_object(self.wrapped_model),
            "name": self.name,
            **self._arguments,
        }

    def __repr__(self) -> str:
        state = self.plan.mesh.describe() if self.is_planned else "not planned yet"
        return (
            f"<TensorParallel {self.wrapped_model.name!r} world_size="
            f"{self.world_size} mesh={self._setup.mesh.describe()} ({state})>"
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"
