"""Which elementwise outputs XLA:GPU keeps for the backward pass rather
than compute again there: the table behind
`keras_autoshard.graph.fusion.MATERIALISED_ON_ACCELERATORS`, measured here
with no GPU.

For each primitive `f` and dtype, a residual stack of `LAYERS` layers
`x + (x W1 * f(x W1)) W2` (tokens 4096, width 1024 → 4096) is
differentiated and compiled by XLA:GPU for one H100 ahead of time
(`gpu_topology`, default options), at two depths. The temporaries grow per
layer by what each layer keeps; `x * x` (nothing but the product and its
operand) is the baseline. A primitive whose layers keep one more
`[tokens, 4096]` buffer than the baseline has its output materialised.
Prints the growth per layer in those buffers and the sets as
`MATERIALISED_ON_ACCELERATORS` holds them (less `LEFT_OUT`).

Run with:

```
python -m benchmarks.fusion_probe
```
"""

from __future__ import annotations

TOKENS, WIDTH, HIDDEN = 4096, 1024, 4096
DEPTHS = (4, 8)
# Kept here with the exponent 0.7, but XLA rewrites a constant exponent 2
# (a Llama RMSNorm's `power(x, 2)`) as a product, which it computes again.
LEFT_OUT = frozenset({"pow"})


def primitives() -> dict:
    """name -> f, each written so that its derivative is not its own
    output alone and its operand is the product (kept anyway)."""
    import jax
    import jax.numpy as jnp

    lax = jax.lax
    return {
        "x*x": lambda x: x,
        "tanh": jnp.tanh,
        "erf": lax.erf,
        "erfc": lax.erfc,
        "logistic": lax.logistic,
        "exp": jnp.exp,
        "log": lambda x: jnp.log(1 + x * x),
        "log1p": lambda x: jnp.log1p(x * x),
        "expm1": jnp.expm1,
        "sin": jnp.sin,
        "cos": jnp.cos,
        "tan": jnp.tan,
        "atan": jnp.arctan,
        "sinh": jnp.sinh,
        "asinh": jnp.arcsinh,
        "sqrt": lambda x: jnp.sqrt(1 + x * x),
        "rsqrt": lambda x: lax.rsqrt(1 + x * x),
        "div": lambda x: 1 / (1 + x * x),
        "cbrt": jnp.cbrt,
        "pow": lambda x: jnp.power(1 + x * x, 0.7),
        "erf_inv": lax.erf_inv,
        "lgamma": lambda x: lax.lgamma(1 + x * x),
    }


def kept_per_layer(f, dtype_name: str) -> float:
    """Temporaries per layer of `x * f(x)`, in `[TOKENS, HIDDEN]` buffers
    of `dtype`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from keras_autoshard.runtime import gpu_targets

    device = gpu_targets.gpu_topology("h100-80gb", 1).devices[0]
    dtype = jnp.dtype(dtype_name)
    temps = []
    for depth in DEPTHS:

        def loss(w1, w2, x, depth=depth):
            for i in range(depth):
                product = (x @ w1[i].astype(dtype)).astype(dtype)
                h = product * f(product)
                x = x + (h @ w2[i].astype(dtype)).astype(dtype)
            return jnp.sum(x.astype(jnp.float32))

        where = SingleDeviceSharding(device)
        shapes = [
            ((depth, WIDTH, HIDDEN), jnp.float32),
            ((depth, HIDDEN, WIDTH), jnp.float32),
            ((TOKENS, WIDTH), dtype),
        ]
        arguments = [jax.ShapeDtypeStruct(s, d, sharding=where) for s, d in shapes]
        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        compiled = step.lower(*arguments).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    unit = TOKENS * HIDDEN * dtype.itemsize
    return (temps[1] - temps[0]) / (DEPTHS[1] - DEPTHS[0]) / unit


def main() -> None:
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sets: dict[int, list[str]] = {2: [], 4: []}
    functions = primitives()
    for dtype_name, itemsize in (("bfloat16", 2), ("float32", 4)):
        base = kept_per_layer(functions["x*x"], dtype_name)
        print(f"{dtype_name}: x*x keeps {base:.2f} buffers per layer")
        for name, f in functions.items():
            if name == "x*x":
                continue
            extra = kept_per_layer(f, dtype_name) - base
            print(f"  {name:9s} {extra:+.2f}")
            if extra >= 0.5 and name not in LEFT_OUT:
                sets[itemsize].append(name)
    print("MATERIALISED_ON_ACCELERATORS = {")
    for itemsize, names in sets.items():
        print(f"    {itemsize}: frozenset({sorted(names)}),")
    print("}")


if __name__ == "__main__":
    main()
