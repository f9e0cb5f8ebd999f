"""`TensorParallel`: the seed project's wrapper API, with real tensor parallelism.

The seed README's two quick-start examples run with only the import line
changed (and the fixes they need to run at all, noted at each) and match the
unwrapped model; the compiled train step carries the all-reduces over the
model axis that the seed README claims are not needed.
"""

import gc
import weakref

import keras
import numpy as np
import pytest

import keras_autoshard as ka
from keras_autoshard import TensorParallel
from keras_autoshard.apply.tensor_parallel_setup import tensor_parallel_setup
from keras_autoshard.building import names_replayed_after
from keras_autoshard.errors import TensorParallelError
from keras_autoshard.report.estimate_check import compiled_peak_bytes
from keras_autoshard.testing import zoo
from tests.parity import assert_close

SEED = 1234
STEPS = 5


def copy_weights(source: keras.Model, target: keras.Model) -> None:
    """Every variable, seed-generator states included, by position."""
    assert [v.path for v in source.variables] == [v.path for v in target.variables]
    for target_variable, source_variable in zip(target.variables, source.variables):
        target_variable.assign(np.asarray(source_variable.value))


def twin(build):
    """(reference, model) built alike from one seed, with identical weights."""
    keras.utils.set_random_seed(SEED)
    with names_replayed_after():
        reference = build()
    model = build()
    copy_weights(reference, model)
    return reference, model


def assert_fit_losses_match(reference, wrapped, x, y, **compile_kwargs):
    reference.compile(**compile_kwargs)
    wrapped.compile(**compile_kwargs)
    batch_size = len(next(iter(x.values())) if isinstance(x, dict) else x)
    fit = dict(epochs=STEPS, batch_size=batch_size, shuffle=False, verbose=0)
    losses_reference = reference.fit(x, y, **fit).history["loss"]
    losses_wrapped = wrapped.fit(x, y, **fit).history["loss"]
    assert len(losses_wrapped) == STEPS
    for step, (a, b) in enumerate(zip(losses_wrapped, losses_reference)):
        assert_close(a, b, f"loss at step {step}")


def optimizer_bytes_split(model: TensorParallel) -> tuple[int, int]:
    """(sharded, replicated) optimizer bytes, split by whether the slot's
    parameter is sharded in the plan; each slot must be laid out like it."""
    sharded = replicated = 0
    specs = {
        v.path.replace("/", "_"): model.plan.variable(v.path).spec
        for v in model.variables
    }
    for slot in model.optimizer.variables:
        nbytes = int(np.prod(slot.shape)) * np.dtype(slot.dtype).itemsize
        owner = max(
            (p for p in specs if slot.name.startswith(p + "_")), key=len, default=None
        )
        if owner is not None and any(specs[owner]):
            slot_spec = tuple(slot.value.sharding.spec)
            assert (
                slot_spec + (None,) * (len(slot.shape) - len(slot_spec))
                == (specs[owner])
            ), slot.path
            sharded += nbytes
        else:
            replicated += nbytes
    return sharded, replicated


def assert_optimizer_state_sharded(
    model: TensorParallel, report, devices: int, min_sharded_fraction: float = 0.9
):
    sharded, replicated = optimizer_bytes_split(model)
    assert sharded > min_sharded_fraction * (sharded + replicated), (
        sharded,
        replicated,
    )
    bound = 1.05 * sharded / devices + replicated
    assert report.optimizer_bytes_per_device <= bound, (
        report.optimizer_bytes_per_device,
        bound,
    )


# ---------------------------------------------------------------- seed example 2
def seed_mlp():
    # As in the seed README (input_shape= on the first layer), unchanged.
    return keras.Sequential(
        [
            keras.layers.Dense(1000, activation="relu", input_shape=(784,)),
            keras.layers.Dense(500, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def test_seed_sequential_example_matches_unwrapped_and_all_reduces_over_model():
    reference, model = twin(seed_mlp)
    rng = np.random.default_rng(0)
    x_train = rng.standard_normal((64, 784)).astype("float32")
    y_train = rng.integers(0, 10, (64,))

    tp_model = TensorParallel(model)  # Auto-detects devices and world_size
    assert tp_model.world_size == 8 and tp_model.setup.mesh.shape == (1, 8)
    assert isinstance(tp_model, TensorParallel)
    assert isinstance(tp_model.distribution, ka.AutoShardDistribution)
    assert_close(tp_model.predict(x_train, verbose=0), reference(x_train), "outputs")
    assert_fit_losses_match(
        reference,
        tp_model,
        x_train,
        y_train,
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
    )
    assert_close(
        tp_model.evaluate(x_train, y_train, verbose=0),
        reference.evaluate(x_train, y_train, verbose=0),
        "evaluate",
    )
    # Megatron pair: first kernel column-cut, second row-cut.
    first, second = (layer.kernel.path for layer in model.layers[:2])
    assert tp_model.plan.variable(first).spec == (None, "model")
    assert tp_model.plan.variable(second).spec == ("model", None)
    report = tp_model.inspect((x_train, y_train))
    assert report.train_step.count("all-reduce", ("model",)) >= 1
    assert_optimizer_state_sharded(tp_model, report, devices=8)


# ---------------------------------------------------------------- seed example 1
def seed_bert():
    import keras_hub

    # The seed loads a preset; the same architecture from a (small) config.
    return keras_hub.models.BertBackbone(
        vocabulary_size=30522,
        num_layers=2,
        num_heads=2,
        hidden_dim=128,
        intermediate_dim=512,
        max_sequence_length=128,
    )


def test_seed_bert_example_matches_unwrapped_with_two_way_tensor_parallelism():
    reference, bert_model = twin(seed_bert)
    tp_bert = TensorParallel(model=bert_model, world_size=2, distributed_backend="jax")
    assert tp_bert.setup.mesh.shape == (4, 2)  # 8 devices: 4-way data parallel
    rng = np.random.default_rng(0)
    # The seed's inputs lack `padding_mask`, which BertBackbone requires, and
    # use `keras.ops.random.randint`, which does not exist.
    inputs = {
        "token_ids": rng.integers(0, 30522, (32, 128)).astype("int32"),
        "segment_ids": np.zeros((32, 128), "int32"),
        "padding_mask": np.ones((32, 128), "int32"),
    }
    labels = rng.integers(0, 2, (32,))
    # The backbone outputs a dict: loss and metric go on "pooled_output" (the
    # seed's bare string loss and metric list are rejected for dict outputs).
    compile_kwargs = dict(
        optimizer="adam",
        loss={
            "pooled_output": keras.losses.SparseCategoricalCrossentropy(True),
            "sequence_output": None,
        },
        metrics={"pooled_output": ["accuracy"]},
    )
    outputs = tp_bert.predict(inputs, batch_size=32, verbose=0)
    expected = reference(inputs)
    for key in ("sequence_output", "pooled_output"):
        assert_close(outputs[key], expected[key], f"{key}")
    y = {"pooled_output": labels, "sequence_output": None}
    assert_fit_losses_match(reference, tp_bert, inputs, y, **compile_kwargs)
    report = tp_bert.inspect((inputs, y))
    assert report.train_step.count("all-reduce", ("model",)) >= 2 * 2  # 2 per layer
    query_kernels = [
        v for v in tp_bert.plan.variables if v.path.endswith("query/kernel")
    ]
    assert len(query_kernels) == 2
    assert all("model" in v.spec for v in query_kernels)


def test_gpt2_world_size_8_cuts_adam_moments_like_their_parameters():
    x = zoo.token_inputs(1024)
    y = zoo.random_targets(zoo.gpt2, x)
    with names_replayed_after():
        tp_model = TensorParallel(zoo.gpt2, sample_input=x)  # built sharded
    tp_model.compile(optimizer="adam", loss="mse")
    report = tp_model.inspect((x, y))
    # Replicated by the planner's choice: embeddings and norms (about 15%).
    assert_optimizer_state_sharded(tp_model, report, 8, min_sharded_fraction=0.8)
    assert report.train_step.count("all-reduce", ("model",)) >= 2 * 2


# ------------------------------------------------------------------- dropout
def dropout_mlp():
    inputs = keras.Input((64,))
    h = keras.layers.Dense(256, activation="relu", name="up")(inputs)
    h = keras.layers.Dropout(0.3, seed=7)(h)  # between the Megatron pair: sharded
    h = keras.layers.Dense(64, name="down")(h)
    h = keras.layers.Dropout(0.3, seed=8)(h)  # after the all-reduce: replicated
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(h))


def test_dropout_masks_and_losses_match_unwrapped_given_same_seed_state():
    reference, model = twin(dropout_mlp)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 64)).astype("float32")
    y = rng.standard_normal((16, 4)).astype("float32")
    tp_model = TensorParallel(model, world_size=4, sample_input=x)
    assert tp_model.plan.variable("up/kernel").spec == (None, "model")
    assert tp_model.plan.variable("down/kernel").spec == ("model", None)
    train_wrapped = tp_model(x, training=True)
    train_reference = reference(x, training=True)
    assert_close(train_wrapped, train_reference, "training-mode outputs")
    inference = reference(x, training=False)
    assert np.max(np.abs(np.asarray(train_reference) - np.asarray(inference))) > 1e-3
    assert_fit_losses_match(
        reference, tp_model, x, y, optimizer=keras.optimizers.SGD(0.05), loss="mse"
    )


# ------------------------------------------------------------ re-layout paths
def functional_mlp():
    inputs = keras.Input((32,), name="features")
    h = keras.layers.Dense(128, activation="gelu", name="up")(inputs)
    return keras.Model(inputs, keras.layers.Dense(32, name="down")(h))


def test_wrapping_built_model_moves_weights_shard_by_shard_and_frees_the_copy():
    _, model = twin(functional_mlp)
    kernel = model.variables[0]
    before = weakref.ref(kernel.value)
    assert len(kernel.value.sharding.device_set) == 1
    tp_model = TensorParallel(model)
    tp_model.prepare(np.zeros((8, 32), "float32"))
    gc.collect()
    assert before() is None, "the single-device copy is still referenced"
    spec = tp_model.plan.variable(kernel.path).spec
    assert "model" in spec
    shard_bytes = {shard.data.nbytes for shard in kernel.value.addressable_shards}
    assert shard_bytes == {32 * 128 * 4 // 8}


def test_builder_and_config_create_variables_already_sharded():
    _, model = twin(functional_mlp)
    config = keras.saving.serialize_keras_object(model)
    for source in (functional_mlp, config):
        tp_model = TensorParallel(source)
        assert not tp_model.is_planned
        assert [v.path for v in tp_model.variables] == [v.path for v in model.variables]
        for variable in tp_model.variables:
            if max(variable.shape) % 8 == 0:
                shards = variable.value.addressable_shards
                assert len(shards) == 8
                assert {s.data.nbytes for s in shards} == {
                    int(np.prod(variable.shape)) * 4 // 8
                }, variable.path


def test_model_built_on_first_batch_keeps_its_unwrapped_variable_paths():
    def unbuilt():
        layers = [keras.layers.Dense(64, name="up"), keras.layers.Dense(8, name="out")]
        return keras.Sequential(layers, name="lazy")

    x = np.ones((8, 16), "float32")
    reference = unbuilt()
    reference(x)
    tp_model = TensorParallel(unbuilt())
    tp_model.compile(optimizer="sgd", loss="mse")
    tp_model.fit(x, np.zeros((8, 8), "float32"), verbose=0)
    paths = [v.path for v in reference.variables]
    assert [v.path for v in tp_model.variables] == paths
    assert [v.path for v in tp_model.plan.variables] == sorted(paths)


def test_device_ids_and_world_size_choose_the_mesh():
    _, model = twin(functional_mlp)
    tp_model = TensorParallel(model, world_size=2, device_ids=["cpu:4", 5, "CPU:6", 7])
    assert tp_model.setup.mesh.shape == (2, 2)
    tp_model.prepare(np.zeros((8, 32), "float32"))
    used = {d.id for v in tp_model.variables for d in v.value.sharding.device_set}
    assert used == {4, 5, 6, 7}
    assert tensor_parallel_setup().mesh.shape == (1, 8)
    assert tensor_parallel_setup(world_size=4).mesh.shape == (2, 4)


# ------------------------------------------------------------ saving, summary
def test_weights_files_load_with_or_without_the_wrapper(tmp_path):
    reference, model = twin(functional_mlp)
    x = np.random.default_rng(2).standard_normal((8, 32)).astype("float32")
    tp_model = TensorParallel(model, world_size=4, sample_input=x)
    tp_model.compile(optimizer="adam", loss="mse")
    tp_model.fit(x, x, epochs=1, batch_size=8, verbose=0)
    weights = str(tmp_path / "tp.weights.h5")
    tp_model.save_weights(weights)
    reference.load_weights(weights)
    assert_close(reference(x), tp_model.predict(x, verbose=0), "after load_weights")
    tp_model.load_weights(weights)

    path = str(tmp_path / "tp.keras")
    tp_model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, TensorParallel) and loaded.world_size == 4
    assert_close(loaded.predict(x, verbose=0), reference(x), "after load_model")
    assert loaded.plan.variable(model.variables[0].path).spec == (None, "model")


def test_summary_lists_the_wrapped_layers():
    _, model = twin(functional_mlp)
    lines = []
    TensorParallel(model).summary(print_fn=lambda line, **_: lines.append(line))
    text = "\n".join(lines)
    assert "down (Dense)" in text and "Total params: 8,352" in text


# --------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 16}, "world_size=16 is larger than the 8 device"),
        ({"world_size": 3}, "world_size=3 does not divide the 8 devices"),
        ({"device_ids": ["gpu:0", "gpu:1"]}, "'gpu:0', which is not an available"),
        ({"device_ids": [0, 9]}, "names device 9, but only 8 devices exist"),
        ({"distributed_backend": "horovod"}, "'horovod' is not one of"),
    ],
)
def test_bad_arguments_raise_errors_naming_the_value(kwargs, message):
    with pytest.raises(TensorParallelError, match=message):
        TensorParallel(functional_mlp(), **kwargs)


@pytest.mark.parametrize("backend", ["torch", "pytorch"])
def test_torch_backend_on_keras_jax_raises_instead_of_falling_back(backend):
    with pytest.raises(TensorParallelError, match="KERAS_BACKEND=torch"):
        TensorParallel(functional_mlp(), distributed_backend=backend)


class ValueDependent(keras.Model):
    """Python control flow on a tensor value: runs eagerly, cannot be traced."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16)

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        if float(keras.ops.max(x)) > 0:
            return self.dense(x)
        return -self.dense(x)


@pytest.mark.parametrize("built", [True, False])
def test_untraceable_model_raises_an_error_that_says_how_to_fix_it(built):
    model = ValueDependent()
    x = np.ones((8, 16), "float32")
    if built:
        model(x)  # fine eagerly
    tp_model = TensorParallel(model)
    tp_model.compile(optimizer="adam", loss="mse")
    with pytest.raises(
        TensorParallelError, match="Cannot trace .*Concretization.*ops.cond"
    ):
        tp_model.fit(x, x, verbose=0)


class RejectsItsArgument(keras.Model):
    """A call that rejects a bad argument, as user code does: not a tracing
    problem."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16)

    def call(self, x):
        if x.shape[-1] != 16:
            raise ValueError(f"expected 16 features, got {x.shape[-1]}")
        return self.dense(x)


def test_a_users_error_in_call_propagates_as_raised_not_as_cannot_trace():
    tp_model = TensorParallel(RejectsItsArgument())
    with pytest.raises(ValueError, match="expected 16 features, got 12") as error:
        tp_model.prepare(np.ones((8, 12), "float32"))
    assert type(error.value) is ValueError


def test_a_shape_error_of_a_built_model_propagates_as_keras_raised_it():
    tp_model = TensorParallel(functional_mlp())  # built for 32 features
    with pytest.raises(ValueError, match="incompatible") as error:
        tp_model.prepare(np.ones((8, 12), "float32"))
    assert type(error.value) is ValueError  # no AutoShardError relabelling it


def test_inspect_of_a_plan_that_rematerializes_compiles_the_recomputation():
    # A budget of 70 % of the free plan's peak makes the planner
    # rematerialize the wrapped model's blocks; `inspect` compiles the step
    # scheduled for memory on XLA:CPU (its defaults merge the recomputation
    # away): the recomputed forward pass is in the program, and the compiled
    # step's peak fits the budget.
    build, batch = zoo.ZOO["subclassed"]
    x = batch()
    y = zoo.random_targets(build, x)
    free = ka.plan(build, ka.MeshSpec((2, 4), ("batch", "model")), x)
    budget = int(0.7 * free.estimate.peak_bytes)
    reports = {}
    for name, limit in (("free", None), ("budget", budget)):
        with names_replayed_after():
            tp_model = TensorParallel(
                build, world_size=4, sample_input=x, memory_budget=limit
            )
        tp_model.compile(optimizer="adam", loss="mse")
        reports[name] = tp_model.inspect((x, y)).train_step
    # The wrapped model's blocks, by path (`subclassed/self_attention_block`
    # when built first in the process).
    wrapped = tp_model.wrapped_model.name
    assert len(tp_model.plan.rematerialize) == 2, tp_model.plan.notes
    assert all(
        name.startswith(f"{wrapped}/self_attention_block")
        for name in tp_model.plan.rematerialize
    ), tp_model.plan.rematerialize
    assert reports["budget"].matmuls > reports["free"].matmuls
    assert compiled_peak_bytes(reports["budget"].memory) <= budget, (
        compiled_peak_bytes(reports["budget"].memory),
        budget,
        tp_model.plan.estimate.to_dict(),
    )
