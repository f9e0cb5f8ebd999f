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

import itertools
import re

TOKENS_LOG2 = (7, 8, 9, 10, 11, 12, 13, 14, 15, 17)
# (M, N) with M × N = 2**12 … 2**23.
OUTPUTS = ((64, 64), (128, 128), (256, 256), (512, 512), (512, 1024), (1024, 1024),
           (2048, 2048), (2048, 4096))  # fmt: skip


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

    table: dict[int, list[tuple[int, int]]] = {}
    for k_log2, (m, n) in itertools.product(TOKENS_LOG2, OUTPUTS):
        parts = {
            split_parts_compiled(2**k_log2, m, n, dtype)
            for dtype in (jnp.float32, jnp.bfloat16)
        }
        if len(parts) > 1:
            print(f"K=2**{k_log2}, {m}x{n}: the dtypes differ: {sorted(parts)}")
        row = table.setdefault(k_log2, [])
        e_log2 = (m * n).bit_length() - 1
        if not row or row[-1][1] != max(parts):
            row.append((e_log2, max(parts)))
    print("SPLITS = {")
    for k_log2, row in table.items():
        print(f"    {k_log2}: {tuple(row)},")
    print("}")


if __name__ == "__main__":
    main()
