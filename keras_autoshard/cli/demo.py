"""The Quickstart demo: shard a small KerasHub GPT-2 and train it.

Builds a GPT-2 backbone from config (no download), plans it for a
(data, model) mesh, trains a few steps sharded and unsharded from the same
weights, prints the plan, the compiled-program report and both loss curves,
and fails if the losses differ by more than 1e-5 relative.
"""

from __future__ import annotations

import logging

import numpy as np
from rich.console import Console
from rich.progress import Progress

logger = logging.getLogger(__name__)

DEMO_GPT2_CONFIG = dict(
    vocabulary_size=1024,
    num_layers=2,
    num_heads=8,
    hidden_dim=256,
    intermediate_dim=1024,
    max_sequence_length=64,
)
LOSS_TOLERANCE = 1e-5


def build_demo_model():
    """The demo's GPT-2 backbone with a small regression head."""
    import keras
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(**DEMO_GPT2_CONFIG, name="gpt2")
    outputs = keras.layers.Dense(1, name="head")(backbone.output)
    return keras.Model(backbone.input, outputs, name="gpt2_regressor")


def demo_batch(batch_size: int, seq_len: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(
            0, DEMO_GPT2_CONFIG["vocabulary_size"], (batch_size, seq_len)
        ).astype("int32"),
        "padding_mask": np.ones((batch_size, seq_len), "int32"),
    }
    y = rng.standard_normal((batch_size, seq_len, 1)).astype("float32")
    return x, y


def make_demo_plan(model, mesh_shape, sample_input):
    """The plan the demo applies, found by the automatic planner."""
    from keras_autoshard.planner.planner import plan
    from keras_autoshard.plans.sharding_plan import MeshSpec

    mesh = MeshSpec(tuple(mesh_shape), ("batch", "model"))
    return plan(model, mesh, sample_input=sample_input)


def run_demo(mesh_shape=(2, 4), steps: int = 5, json_path: str | None = None) -> int:
    """Run the demo; returns a process exit code (0 when losses match).

    Args:
        mesh_shape: (data, model) mesh sizes.
        steps: Number of training steps.
        json_path: Where to write the compiled-program report as JSON.

    Returns:
        0 if the sharded losses match the single-device ones, 1 otherwise.
    """
    import keras

    from keras_autoshard import PlanDistribution, inspect_compiled
    from keras_autoshard.trace.naming import names_replayed_after

    console = Console()
    batch_size = 4 * mesh_shape[0]
    x, y = demo_batch(batch_size)
    keras.utils.set_random_seed(0)
    with names_replayed_after():
        reference = build_demo_model()
    plan = make_demo_plan(reference, mesh_shape, x)
    print(plan.summary())
    print(plan.explain())

    distribution = PlanDistribution(plan)
    with distribution.scope():
        sharded = build_demo_model()
        for target, source in zip(sharded.variables, reference.variables):
            target.assign(np.asarray(source.value))
        sharded.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
        report = inspect_compiled(sharded, distribution, (x, y))
    reference.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    print(report.table())
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(report.to_json())

    losses = []
    with Progress(console=console) as progress:
        task = progress.add_task("training (sharded and single-device)", total=steps)
        for _ in range(steps):
            loss_reference = float(reference.train_on_batch(x, y))
            with distribution.scope():
                loss_sharded = float(sharded.train_on_batch(x, y))
            losses.append((loss_reference, loss_sharded))
            progress.advance(task)
    worst = 0.0
    for step, (loss_reference, loss_sharded) in enumerate(losses):
        error = abs(loss_sharded - loss_reference) / abs(loss_reference)
        worst = max(worst, error)
        console.print(
            f"step {step}: single-device loss {loss_reference:.6f}  "
            f"sharded loss {loss_sharded:.6f}  relative difference {error:.2e}"
        )
    ok = worst <= LOSS_TOLERANCE
    verdict = "match" if ok else "DIFFER"
    console.print(
        f"Losses {verdict}: worst relative difference {worst:.2e} "
        f"(tolerance {LOSS_TOLERANCE:g}) on mesh {plan.mesh.describe()}."
    )
    return 0 if ok else 1
