"""Compare a sharded model against the same model on one device.

Both models start from identical weights; forward outputs, gradients and the
losses and weights after several Adam steps are compared with a tolerance
relative to each tensor's scale.
"""

import hashlib

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_autoshard import rematerialize
from keras_autoshard.building import names_replayed_after
from keras_autoshard.testing.parity import relative_error

RELATIVE_TOLERANCE = 1e-5
PARITY_SEED = 1234


def assert_close(
    actual, expected, what: str, tol: float = RELATIVE_TOLERANCE, scale_floor=0.0
):
    error = relative_error(actual, expected, scale_floor)
    assert error <= tol, f"{what}: relative error {error:.3g} > {tol:g}"


def outputs_and_gradients(model, x, y):
    """The forward output leaves and the gradients of the mean squared error
    w.r.t. the trainable variables, from one jitted program (as `predict`
    and `fit` run a model: jitted, not op by op; a model called eagerly
    under a plan is checked in `tests/graph/test_other_shapes.py`)."""
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_fn(trainable_values):
        y_pred, _ = model.stateless_call(trainable_values, non_trainable, x)
        errors = jax.tree_util.tree_map(
            lambda p, t: jnp.mean(jnp.square(p - t)), y_pred, y
        )
        return sum(jax.tree_util.tree_leaves(errors)), jax.tree_util.tree_leaves(y_pred)

    (_, outputs), gradients = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        trainable
    )
    return outputs, gradients


def build_pair(build, distribution):
    """(reference model on one device, sharded model) with identical weights.

    The initial weights are seeded so that a run is reproducible: a ReLU input
    within rounding distance of zero is a real kink (the two models may take
    different sides of it), and a fixed seed keeps that from turning an
    unrelated run red by chance.
    """
    keras.utils.set_random_seed(PARITY_SEED)
    with names_replayed_after():
        reference = build()
    with distribution.scope():
        sharded = build()
    assert [v.path for v in reference.variables] == [v.path for v in sharded.variables]
    # Every variable, seed-generator states included (`set_weights` skips them).
    for target, source in zip(sharded.variables, reference.variables):
        target.assign(np.asarray(source.value))
    return reference, sharded


def distribute_batch(distribution, tree):
    def put(a):
        layout = distribution.get_data_layout(a.shape).backend_layout
        return jax.device_put(a, layout)

    return jax.tree_util.tree_map(put, tree)


# Adam's epsilon in parity runs, 1e-6 instead of Keras's 1e-7: for gradients
# near epsilon, Adam's update g / (|g| + eps) turns reduction-order rounding
# (1e-7 relative) into update differences of 1e-3 relative; 1e-6 keeps that
# below tolerance without changing what is compared.
ADAM_EPSILON = 1e-6


def _adam(accumulation_steps: int = 1):
    return keras.optimizers.Adam(
        1e-3,
        epsilon=ADAM_EPSILON,
        gradient_accumulation_steps=(
            accumulation_steps if accumulation_steps > 1 else None
        ),
    )


def _digest(*trees) -> str:
    """A fingerprint of every array in `trees` (shapes, dtypes and bytes)."""
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(trees):
        array = np.asarray(leaf)
        digest.update(f"{array.shape}{array.dtype}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


# One-device runs already made in this session, by (builder, batch, initial
# weights, steps, accumulation): the same model trained on the same batch
# from the same weights is the same reference on every mesh, so it is run
# once (its outputs, gradients, losses and trained weights are kept).
_REFERENCE_RUNS: dict[tuple, dict] = {}


def _reference_run(build, reference, x, y, steps, accumulation_steps) -> dict:
    key = (
        build,
        _digest(x, y),
        _digest([v.value for v in reference.variables]),
        steps,
        accumulation_steps,
    )
    if key not in _REFERENCE_RUNS:
        outputs, gradients = outputs_and_gradients(reference, x, y)
        outputs = [np.asarray(o) for o in outputs]
        gradients = [np.asarray(g) for g in gradients]
        reference.compile(optimizer=_adam(accumulation_steps), loss="mse")
        losses = [reference.train_on_batch(x, y) for _ in range(steps)]
        weights = [np.asarray(v.value) for v in reference.trainable_variables]
        _REFERENCE_RUNS[key] = {
            "outputs": outputs,
            "gradients": gradients,
            "losses": losses,
            "weights": weights,
        }
    return _REFERENCE_RUNS[key]


# How many nudged one-device runs `adam_steps_sensitivity` makes, and how far
# (relative) each nudges every trainable weight: the order of one rounding.
SENSITIVITY_RUNS = 3
NUDGE = 1e-7


def _trained_from(build, initial, x, y, steps, accumulation_steps):
    """(losses, trained weights) of a fresh one-device model of `build` that
    starts from `initial` (one array per variable) and takes `steps` steps."""
    with names_replayed_after():
        model = build()
    for variable, value in zip(model.variables, initial):
        variable.assign(value)
    model.compile(optimizer=_adam(accumulation_steps), loss="mse")
    losses = [model.train_on_batch(x, y) for _ in range(steps)]
    return losses, [np.asarray(v.value) for v in model.trainable_variables]


def _weight_scale(expected) -> float:
    """The largest trained weight of a reference run: the scale each trained
    weight is judged against (biases start at zero)."""
    return max(float(np.max(np.abs(w))) for w in expected["weights"])


def _steps_error(losses, weights, expected) -> float:
    """How far (relative) `losses` and trained `weights` are from the
    reference run's, as `check_parity` judges them."""
    weight_scale = _weight_scale(expected)
    return max(
        *(relative_error(a, b) for a, b in zip(losses, expected["losses"])),
        *(
            relative_error(w, r, scale_floor=weight_scale)
            for w, r in zip(weights, expected["weights"])
        ),
    )


def adam_steps_sensitivity(build, initial, x, y, expected, steps, accumulation_steps):
    """How far the one-device losses and weights after `steps` Adam steps move
    when every trainable float weight moves by ±`NUDGE` (relative, each sign
    at random, seeded), the largest of `SENSITIVITY_RUNS` runs.

    A sharded run differs from one device by the order of its sums, which is
    a change of this size at every step. A model whose training moves by
    more than the tolerance under this nudge on one device alone (a ReLU
    input within rounding of zero, whose gradient flips; Adam then turns a
    rounding-sized gradient into a full learning-rate step) is
    ill-conditioned at that seed, not wrongly sharded; `check_parity` then
    judges its steps against twice this measured change. Measured once per
    reference run (kept in `expected`, `_reference_run`'s record), for every
    mesh checked.

    Args:
        build: The model builder.
        initial: `(trainable, initial value)` of every variable of the
            reference, in `model.variables` order.
        x, y: The batch.
        expected: The reference run of `_reference_run` from `initial`.
        steps, accumulation_steps: As the reference run.
    """
    if "sensitivity" not in expected:
        rng = np.random.default_rng(PARITY_SEED)
        worst = 0.0
        for _ in range(SENSITIVITY_RUNS):
            nudged = [
                value
                * (1 + NUDGE * rng.choice([-1.0, 1.0], size=value.shape)).astype(
                    value.dtype
                )
                if is_trainable and value.dtype.kind == "f"
                else value
                for is_trainable, value in initial
            ]
            losses, weights = _trained_from(
                build, nudged, x, y, steps, accumulation_steps
            )
            worst = max(worst, _steps_error(losses, weights, expected))
        expected["sensitivity"] = worst
    return expected["sensitivity"]


def check_parity(
    build,
    distribution,
    x,
    y,
    steps: int = 5,
    accumulation_steps: int = 1,
    ill_conditioned: str = "",
):
    """Assert forward, gradient and `steps` Adam-step parity (both optimizers
    accumulating gradients over `accumulation_steps`); return the pair. The
    one-device reference is run once per builder, batch and initial weights
    (`_reference_run`): the returned reference is trained only by the first
    check that ran it.

    `ill_conditioned` (why, measured) earns the steps a bound of twice
    `adam_steps_sensitivity` instead of the tolerance; the model must then
    move by at least half the tolerance under the nudge, so that a listed
    model that is no longer ill-conditioned fails. Forward outputs and
    gradients keep the tolerance."""
    reference, sharded = build_pair(build, distribution)
    if hasattr(distribution, "prepare") and not distribution.is_planned:
        distribution.prepare(sharded, x)  # AutoShardDistribution plans here
    initial = [(v.trainable, np.asarray(v.value)) for v in reference.variables]
    expected = _reference_run(build, reference, x, y, steps, accumulation_steps)
    steps_tolerance = RELATIVE_TOLERANCE
    if ill_conditioned:
        sensitivity = adam_steps_sensitivity(
            build, initial, x, y, expected, steps, accumulation_steps
        )
        assert sensitivity >= RELATIVE_TOLERANCE / 2, (
            f"{steps} Adam steps move by {sensitivity:.3g} only under a "
            f"{NUDGE:g} nudge: not ill-conditioned ({ill_conditioned}); take "
            "the model off its list"
        )
        steps_tolerance = max(RELATIVE_TOLERANCE, 2 * sensitivity)
    with distribution.scope():
        x_sharded = distribute_batch(distribution, x)
        y_sharded = distribute_batch(distribution, y)
        outputs_sharded, grads_sharded = outputs_and_gradients(
            sharded, x_sharded, y_sharded
        )
    assert len(outputs_sharded) == len(expected["outputs"])
    outputs = zip(outputs_sharded, expected["outputs"])
    for index, (out_sharded, out_reference) in enumerate(outputs):
        assert_close(out_sharded, out_reference, f"forward output {index}")
    grads_reference = expected["gradients"]
    # A gradient's scale is judged against 1e-3 of the largest gradient.
    floor = 1e-3 * max(float(np.max(np.abs(g))) for g in grads_reference)
    for v, g_s, g_r in zip(
        reference.trainable_variables, grads_sharded, grads_reference
    ):
        assert_close(g_s, g_r, f"gradient of {v.path}", scale_floor=floor)

    with distribution.scope():
        sharded.compile(optimizer=_adam(accumulation_steps), loss="mse")
    for step, loss_reference in enumerate(expected["losses"]):
        with distribution.scope():
            loss_sharded = sharded.train_on_batch(x, y)
        assert_close(
            loss_sharded, loss_reference, f"loss at step {step}", steps_tolerance
        )
    # Weights that start at zero (biases) are judged against the model's
    # weight scale: Adam turns rounding noise in near-zero gradients into
    # update differences of ~1e-7, huge relative to a 5e-3 bias.
    weight_scale = _weight_scale(expected)
    for v_s, w_r in zip(sharded.trainable_variables, expected["weights"]):
        assert_close(
            v_s.value,
            w_r,
            f"{v_s.path} after {steps} steps",
            steps_tolerance,
            scale_floor=weight_scale,
        )
    return reference, sharded


def rematerialized_under(sharding_plan, build):
    """`build`, rematerializing as planned when built under a distribution
    (the sharded model of `check_parity`; the one-device reference is not)."""

    def build_model():
        model = build()
        if keras.distribution.distribution() is not None:
            rematerialize(model, sharding_plan)
        return model

    return build_model
