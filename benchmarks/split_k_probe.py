"""What XLA:GPU's split-K does to weight gradients: the table behind
`keras_autoshard.planner.split_k.SPLITS`, measured here with no GPU.

For every `K` (tokens) and output size `M × N` on a grid of powers of two,
compile a lone `einsum("km,kn->mn")` (float32 and bfloat16 operands,
float32 result) with XLA:GPU for one H100 ahead of time (`gpu_topology`,
default options) and read how many partial products its GEMM fusion makes
(the leading dim of a rank-3 fusion result; 1 when it makes none). Prints
the table as `SPLITS` holds it, and says where the two dtypes differ.

Run with:

```
python -m benchmarks.split_k_probe
```
"""

from __future__ import annotations

import re

TOKENS_LOG2 = (7, 8, 9, 10, 11, 12, 13, 14, 15, 17)
# The output's two dims, each 2**4 … 2**12: XLA:GPU's choice depends on
# both (a 256 x 32 output of 512 tokens is split in 8, a 64 x 128 one with
# as many elements in 16), not on their product alone.
DIMS_LOG2 = tuple(range(4, 13))


def split_parts_compiled(tokens: int, m: int, n: int, dtype) -> int:
    """Partial products of XLA:GPU's GEMM for `tokens` into `m × n`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from keras_autoshard.runtime import gpu_targets

    topology = gpu_targets.gpu_topology("h100-80gb", 1)
    mesh = Mesh(np.array(topology.devices).reshape(1), ("x",))
    whole = NamedSharding(mesh, PartitionSpec())

    def product(a, b):
        return jnp.einsum("km,kn->mn", a, b, preferred_element_type=jnp.float32)

    compiled = (
        jax.jit(product)
        .lower(
            jax.ShapeDtypeStruct((tokens, m), dtype, sharding=whole),
            jax.ShapeDtypeStruct((tokens, n), dtype, sharding=whole),
        )
        .compile()
    )
    found = re.findall(r"= f32\[(\d+),(\d+),(\d+)\]\S* fusion", compiled.as_text())
    return int(found[0][0]) if found else 1


def main() -> None:
    import jax.numpy as jnp

    print("SPLITS = {")
    for k_log2 in TOKENS_LOG2:
        print(f"    {k_log2}: (")
        for m_log2 in DIMS_LOG2:
            row = []
            for n_log2 in DIMS_LOG2:
                m, n = 2**m_log2, 2**n_log2
                parts = {
                    split_parts_compiled(2**k_log2, m, n, dtype)
                    for dtype in (jnp.float32, jnp.bfloat16)
                }
                if len(parts) > 1:
                    print(f"# K=2**{k_log2}, {m}x{n}: the dtypes differ: {parts}")
                row.append(max(parts))
            print(f"        {tuple(row)},  # M = 2**{m_log2}", flush=True)
        print("    ),")
    print("}")


if __name__ == "__main__":
    main()
