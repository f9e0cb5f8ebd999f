"""Fine-tune a KerasHub Gemma-shaped causal LM under an automatic plan.

The model (a GemmaBackbone and its tied-embedding language-model head) is
built from config (no download, random weights), planned for a
(data, model) mesh without allocating any weight, printed, saved as JSON, and
then built for real with every variable created directly in its planned
layout and fine-tuned for a few steps on next-token prediction.

Runs on CPU with 8 simulated devices in well under a minute by default:

    python examples/finetune_gemma_plan.py
    python examples/finetune_gemma_plan.py --layers 4 --hidden 512 --steps 20

On a machine with accelerators the same script uses them (no simulation).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_autoshard as ka  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--mesh", default="2x4", help="data x model, e.g. 2x4")
    parser.add_argument("--memory-budget-mib", type=float, default=None)
    parser.add_argument("--plan-json", default=None, help="save the plan here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    data_size, model_size = (int(s) for s in args.mesh.split("x"))
    ka.simulate_devices(data_size * model_size)  # before JAX starts

    import keras
    import keras_hub
    import numpy as np

    def build_causal_lm():
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=args.vocab,
            num_layers=args.layers,
            num_query_heads=args.heads,
            num_key_value_heads=args.heads,
            hidden_dim=args.hidden,
            intermediate_dim=4 * args.hidden,
            head_dim=args.hidden // args.heads,
        )
        # The language-model head of GemmaCausalLM: logits from the tied
        # token embedding. (KerasHub task classes compile an optimizer as
        # they are built, which a weightless planning build cannot do.)
        logits = backbone.token_embedding(backbone.output, reverse=True)
        return keras.Model(backbone.input, logits, name="gemma_causal_lm")

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq_len + 1)).astype("int32")
    x = {
        "token_ids": tokens[:, :-1],
        "padding_mask": np.ones((args.batch, args.seq_len), "int32"),
    }
    y = tokens[:, 1:]

    mesh = ka.MeshSpec((data_size, model_size), ("batch", "model"))
    budget = (
        None if args.memory_budget_mib is None else int(args.memory_budget_mib * 2**20)
    )
    # Planning builds the model abstractly: shapes only, no weights.
    plan = ka.plan(
        build_causal_lm, mesh, sample_input=x, memory_budget=budget, progress=True
    )
    print(plan.summary(max_rows=12))
    if args.plan_json:
        plan.save(args.plan_json)
        print(f"Saved the plan to {args.plan_json}")

    distribution = ka.PlanDistribution(plan)
    with distribution.scope():
        keras.utils.set_random_seed(0)
        model = build_causal_lm()  # every variable is created in its layout
        model.compile(
            optimizer=keras.optimizers.AdamW(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        losses = [float(model.train_on_batch(x, y)) for _ in range(args.steps)]
    embedding = model.get_layer("token_embedding").embeddings.value
    print(f"token embedding sharding: {embedding.sharding.spec}")
    print(
        f"Fine-tuned {args.steps} steps on mesh {plan.mesh.describe()}: "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    )


if __name__ == "__main__":
    main()
