"""Trace a Keras model abstractly: shapes and dtypes only, no weights.

A model (or a function that builds one) is built inside a Keras
`StatelessScope` that never initialises variables, and its forward pass is
traced by `jax.make_jaxpr` over `jax.ShapeDtypeStruct` leaves. Nothing the
size of a weight is ever allocated, so models far larger than memory can be
planned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import traceback
from collections.abc import Callable
from typing import Any

import jax
import keras
import numpy as np

from keras_autoshard.compat import keras_globals, keras_private
from keras_autoshard.errors import ModelNotTraceableError, PlanError
from keras_autoshard.plans.identity import unique_variables, variable_keys
from keras_autoshard.trace.naming import names_replayed_after
from keras_autoshard.trace.parts import (
    call_takes_training,
    has_own_call,
    model_parts,
    parts_forward,
)

logger = logging.getLogger(__name__)

# JAX's errors for a traced value used where a concrete one is needed: the
# call cannot be traced. Any other error is the model's or the caller's own,
# unless its message shows a tracer (a traced size given as a shape raises
# a plain TypeError naming `JitTracer(~int32[])`).
TRACING_ERRORS = (
    jax.errors.ConcretizationTypeError,  # TracerBoolConversionError too
    jax.errors.NonConcreteBooleanIndexError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.UnexpectedTracerError,
)
_TRACER_IN_MESSAGE = re.compile(r"tracer|Traced<", re.IGNORECASE)

# What plans a model of another backend (in a JAX subprocess).
_PLANNING_ELSEWHERE = {
    "tensorflow": (
        "keras_autoshard.AutoShardDistribution and TensorParallel(model) plan "
        "in a JAX subprocess on TensorFlow, and plan_for_tensorflow(model, mesh, "
        "sample_input) from keras_autoshard.apply.tensorflow.planning returns "
        "the plan alone"
    ),
    "torch": (
        "TensorParallel(model), launched with torchrun, plans in a JAX "
        "subprocess on PyTorch, and plan_for_torch(model, mesh, sample_input) "
        "from keras_autoshard.apply.torch.planning returns the plan alone"
    ),
}


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    """What the planner needs of a model variable.

    Args:
        path: Its plan key: the Keras path, with `#<n>` added where several
            variables share the path (see `plans/identity.py`).
        shape: Its shape.
        dtype: Its dtype name.
        trainable: Whether it is trained.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool


@dataclasses.dataclass(frozen=True)
class TracedModel:
    """The abstract trace of one forward pass.

    Args:
        closed_jaxpr: The forward pass as a `jax.core.ClosedJaxpr`.
        invar_kinds: (kind, name) per flattened jaxpr input: `("param",
            path)`, `("state", path)` or `("input", name)`.
        variables: Trainable variables, then non-trainable, in model order.
        input_shapes: Name → shape of each model input as traced.
        notes: What the plan's notes say about the trace.
        inputs_made_in_step: Traced through its parts (`trace/parts.py`):
            the inputs are batches the train step makes, not ones it is fed.
    """

    closed_jaxpr: Any
    invar_kinds: tuple[tuple[str, str | None], ...]
    variables: tuple[VariableInfo, ...]
    input_shapes: dict[str, tuple[int, ...]]
    notes: tuple[str, ...] = ()
    inputs_made_in_step: bool = False


@contextlib.contextmanager
def abstract_variables():
    """Create Keras variables without values inside this block.

    Variables created here keep `_value = None` for good: they are removed
    from Keras's list of variables awaiting initialisation, so no later
    stateless scope initialises (allocates) them.
    """
    with (
        keras_globals.pending_initializations_set_aside(),
        keras.StatelessScope(initialize_variables=False),
    ):
        yield


def build_abstract(builder: Callable[[], keras.Model]) -> keras.Model:
    """Build a model whose variables have shapes but no values.

    The build leaves Keras's name counters as it found them, so the next real
    build of the same model gets the same variable paths.

    A KerasHub task (a `CausalLM`, whose constructor compiles an optimizer
    with a counter made from a value, which no abstract build can hold) is
    built around an abstract backbone instead, outside this function.

    Args:
        builder: A function with no arguments returning a `keras.Model`.

    Returns:
        The model, usable only for abstract tracing.

    Raises:
        ModelNotTraceableError: If the builder creates a variable from a
            value (an optimizer's): the message says how to plan a task.

    Example:

    ```python
    backbone = build_abstract(lambda: keras_hub.models.LlamaBackbone(**config))
    causal_lm = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    sharding_plan = plan(causal_lm, mesh, batch, job="generate")
    ```
    """
    with names_replayed_after(), abstract_variables():
        try:
            model = builder()
        except ValueError as error:
            if "create a variable while in a stateless scope" not in str(error):
                raise
            raise ModelNotTraceableError(
                "The model builder creates a variable from a value (an "
                "optimizer's counter: a KerasHub task's constructor compiles "
                "one), which an abstract build cannot hold. Build the backbone "
                "abstractly and the task around it, then plan the task: "
                "plan(Task(backbone=keras_autoshard.building.build_abstract("
                "make_backbone), preprocessor=None), ...)."
            ) from error
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"The model builder returned {type(model).__name__}, not a keras.Model."
        )
    return model


def shape_structs(tree):
    """Replace every array-like leaf by a `jax.ShapeDtypeStruct`."""

    def to_struct(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return jax.ShapeDtypeStruct(tuple(leaf.shape), np.dtype(str(leaf.dtype)))
        return leaf

    return jax.tree_util.tree_map(to_struct, tree)


def trace_model(model: keras.Model, sample_input) -> TracedModel:
    """Trace `model`'s forward pass (training mode) over shapes only.

    Args:
        model: A built Keras model (its variables may be abstract).
        sample_input: Inputs as the model takes them (arrays, dicts of arrays,
            or `jax.ShapeDtypeStruct`s); only shapes and dtypes are used.

    Returns:
        A `TracedModel`.

    Raises:
        PlanError: Keras runs on another backend than JAX in this process.
        ModelNotTraceableError: `jax.jit` cannot trace the forward pass (a
            JAX tracing error, `TRACING_ERRORS`); any other error of the
            call (a shape error, a bad argument) propagates as raised.
    """
    _require_jax_backend(model)
    parts = None if has_own_call(model) else model_parts(model, sample_input)
    if parts is None and not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built: give sample_input so it can be "
            "built, or build it first."
        )
    trainable = unique_variables(model.trainable_variables)
    non_trainable = unique_variables(model.non_trainable_variables)
    # Plan keys: the path, told apart by order where paths repeat.
    keys = variable_keys(model.variables)
    inputs = shape_structs(sample_input if parts is None else parts.inputs)
    kwargs = {}
    if call_takes_training(model):
        kwargs["training"] = True

    def forward(trainable_values, non_trainable_values, x):
        outputs, _ = model.stateless_call(
            trainable_values, non_trainable_values, x, **kwargs
        )
        return outputs

    if parts is not None:
        forward = parts_forward(parts, trainable, non_trainable)

    try:
        with _unfiltered_tracebacks():
            closed = jax.make_jaxpr(forward)(
                [_struct(v) for v in trainable],
                [_struct(v) for v in non_trainable],
                inputs,
            )
    except Exception as error:
        if tracing_error_in(error) is None:
            raise  # the model's own error (a shape, an argument): as raised
        raise not_traceable_error(model, error) from error
    input_leaves, _ = jax.tree_util.tree_flatten_with_path(inputs)
    input_names = [_keystr(path) for path, _ in input_leaves]
    invar_kinds = (
        [("param", keys[id(v)]) for v in trainable]
        + [("state", keys[id(v)]) for v in non_trainable]
        + [("input", name) for name in input_names]
    )
    if len(invar_kinds) != len(closed.jaxpr.invars):
        raise RuntimeError(
            f"Traced {len(closed.jaxpr.invars)} inputs but expected "
            f"{len(invar_kinds)}; the model call may close over arrays."
        )
    return TracedModel(
        closed_jaxpr=closed,
        invar_kinds=tuple(invar_kinds),
        variables=tuple(
            VariableInfo(
                keys[id(v)], tuple(int(s) for s in v.shape), str(v.dtype), True
            )
            for v in trainable
        )
        + tuple(
            VariableInfo(
                keys[id(v)], tuple(int(s) for s in v.shape), str(v.dtype), False
            )
            for v in non_trainable
        ),
        input_shapes={
            name: tuple(leaf.shape)
            for name, (_, leaf) in zip(input_names, input_leaves)
        },
        notes=() if parts is None else (parts.note,),
        inputs_made_in_step=parts is not None,
    )


def _require_jax_backend(model: keras.Model) -> None:
    """Refuse to trace under another Keras backend: JAX cannot trace its
    tensors, and the failure would read as a fault of the model."""
    backend = keras.backend.backend()
    if backend == "jax":
        return
    elsewhere = _PLANNING_ELSEWHERE.get(backend)
    instead = f" To stay on {backend}: {elsewhere}." if elsewhere else ""
    raise PlanError(
        f"Planning traces the model with JAX, but Keras runs on {backend!r} in "
        f"this process: model {model.name!r} is a {backend} model, which JAX "
        "cannot trace (the model is not at fault). Set KERAS_BACKEND=jax "
        f"before importing Keras to plan in this process.{instead}"
    )


def tracing_error_in(error: BaseException) -> BaseException | None:
    """The JAX tracing error that `error` is or was raised from, following
    its chain of causes: one of `TRACING_ERRORS`, else the innermost error
    whose message shows a tracer; `None` when there is none.

    Args:
        error: An exception raised while building or tracing a model.

    Returns:
        The tracing error of the chain, or `None`.
    """
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    typed = [e for e in chain if isinstance(e, TRACING_ERRORS)]
    if typed:
        return typed[0]
    worded = [e for e in chain if _TRACER_IN_MESSAGE.search(str(e))]
    return worded[-1] if worded else None


def not_traceable_error(model: keras.Model, error: Exception) -> ModelNotTraceableError:
    """A `ModelNotTraceableError` for `error`, raised while tracing `model`:
    it names the innermost layer being called and the innermost source line
    outside JAX and Keras (the model's own code) at the point of failure."""
    layer, source = None, None
    for frame, line_number in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.Operation) and owner is not model:
            layer = owner
        filename = frame.f_code.co_filename
        if not any(part in filename for part in _LIBRARY_PATHS):
            short = filename.split("site-packages/")[-1]
            source = f"{short}:{line_number} ({frame.f_code.co_name})"
    where = (
        f" in layer {layer.name!r} ({type(layer).__name__})"
        if layer is not None
        else ""
    )
    line = f", at {source}" if source else ""
    cause = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
    return ModelNotTraceableError(
        f"Model {model.name!r} ({type(model).__name__}) cannot be traced by "
        f"jax.jit with these inputs: tracing stopped{where}{line} with {cause}. "
        "Planning and every sharded step trace the forward pass with abstract "
        "inputs, so the call must not turn an input or a weight into a Python "
        "value (a loop count, a shape, an `if`). Pass such values as Python "
        "numbers or constructor arguments instead of inputs, or make the layer "
        "compute them with ops."
    )


@contextlib.contextmanager
def _unfiltered_tracebacks():
    """Keras's traceback filtering off (it drops the frames of the layer that
    failed), as it was afterwards."""
    was_enabled = keras.config.is_traceback_filtering_enabled()
    keras.config.disable_traceback_filtering()
    try:
        yield
    finally:
        if was_enabled:
            keras.config.enable_traceback_filtering()


# Source files that are not the model's own code.
_LIBRARY_PATHS = (
    "/jax/",
    "/jaxlib/",
    keras_private.KERAS_SOURCE_PATH_PART,
    "/keras_autoshard/",
    "<",
)


def _struct(variable) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(
        tuple(int(s) for s in variable.shape), np.dtype(str(variable.dtype))
    )


def _keystr(path) -> str:
    if not path:
        return "input"
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
