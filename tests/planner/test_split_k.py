"""Unit tests of `planner/split_k.py` and the graph facts it reads
(`graph/fusion.py`'s `product_images`), on small jaxprs written here."""

import jax
import jax.numpy as jnp
import pytest

from keras_autoshard.graph.builder import build_axis_graph
from keras_autoshard.planner.accelerator_peak import accelerator_peak
from keras_autoshard.planner.cost_model import Assignment
from keras_autoshard.planner.split_k import (
    activation_products,
    input_gradient_partials,
    kept_partials_factors,
    merged_split_gradient_bytes,
    norm_read_partials_factors,
    partials_made_by,
    split_parts,
    split_sums_of_several_products,
)

TOKENS, WIDTH, HIDDEN = 64, 256, 512
UNCUT = Assignment(class_axis={})


def _graph(f, shapes, kinds):
    closed = jax.make_jaxpr(f)(*[jax.ShapeDtypeStruct(s, "float32") for s in shapes])
    return build_axis_graph(closed, kinds)


def gated(approximate: bool):
    """A normalised input scaled by a trained vector, a gate and an up
    projection reading it (GELU of the gate times the up), a down one."""

    def f(scale, gate, up, down, x):
        h = x * scale
        g = h @ gate
        return (jax.nn.gelu(g, approximate=approximate) * (h @ up)) @ down

    shapes = [(WIDTH,), (WIDTH, HIDDEN), (WIDTH, HIDDEN), (HIDDEN, WIDTH)]
    kinds = [("param", n) for n in ("scale", "gate", "up", "down")]
    return _graph(f, [*shapes, (TOKENS, WIDTH)], [*kinds, ("input", "x")])


def _product_of(graph, weight: str) -> int:
    param = graph.param(weight).id
    (out,) = [o for o, lhs, rhs, _ in graph.products if param in (lhs, rhs)]
    return out


def test_products_the_backward_pass_needs_as_they_are():
    graph = gated(approximate=True)
    fused = {out: needed for out, _, needed in graph.fused_products}
    gate, up, down = (_product_of(graph, w) for w in ("gate", "up", "down"))
    # The GELU's input and the up projection's output are read by the
    # backward pass; the down projection's output by nothing.
    assert fused == {gate: True, up: True, down: False}


def test_an_exact_gelu_keeps_no_partials():
    """Its `erfc`'s forward fusion emits the product beside it (XLA:GPU,
    the zoo's MLP on 2x4): the gate is no fused product."""
    graph = gated(approximate=False)
    fused = {out for out, _, _ in graph.fused_products}
    assert _product_of(graph, "gate") not in fused
    assert _product_of(graph, "up") in fused


def test_kept_partials_of_a_merged_product():
    """Gate and up read one input: one product of 64 tokens by 1024
    features over 256, which `split_parts` splits in 4; each kept output
    holds its share of the 4 float32 partials of the merged output."""
    graph = gated(approximate=True)
    gate, up = _product_of(graph, "gate"), _product_of(graph, "up")
    assert split_parts(WIDTH, TOKENS, 2 * HIDDEN) == 4
    assert kept_partials_factors(
        graph, activation_products(graph, UNCUT, {}), frozenset({gate, up})
    ) == {
        gate: 4.0,
        up: 4.0,
    }
    # Only the gate kept: the partials still hold the up's half.
    assert kept_partials_factors(
        graph, activation_products(graph, UNCUT, {}), frozenset({gate})
    ) == {gate: 8.0}
    assert (
        kept_partials_factors(graph, activation_products(graph, UNCUT, {}), frozenset())
        == {}
    )


def test_more_partials_than_xla_keeps_are_not_kept():
    """Gate and up cut 4 ways over their features (64 tokens by 256 over
    256 on a device): `split_parts` says 8, more than XLA:GPU keeps in the
    output's place where an expensive primitive reads it (the GELU's tanh:
    `KEPT_PARTS_LIMIT`; BERT's MLP on 2x4, split in 8, has its biased
    product emitted instead)."""
    graph = gated(approximate=True)
    gate, up = _product_of(graph, "gate"), _product_of(graph, "up")
    # The gate's GELU turns it by a tanh; the up is only multiplied.
    assert set(graph.expensively_read_products) == {gate}
    features = graph.tensors[gate].dim_classes[1]
    cut = Assignment(class_axis={features: "model"})
    assert split_parts(WIDTH, TOKENS, 2 * HIDDEN / 4) == 8
    kept = frozenset({gate, up})
    assert (
        kept_partials_factors(
            graph, activation_products(graph, cut, {"model": 4}), kept
        )
        == {}
    )


STREAM_TOKENS = 256


def residual_stream():
    """Two residual blocks `x + relu(rms(x) @ up) @ down` (256 tokens,
    256 -> 512 -> 256) and a last RMS norm, as XLA:GPU keeps residuals;
    the two down projections' outputs."""

    def rms(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True)) * scale

    def f(s1, up1, down1, s2, up2, down2, s3, x):
        x = x + jax.nn.relu(rms(x, s1) @ up1) @ down1
        x = x + jax.nn.relu(rms(x, s2) @ up2) @ down2
        return rms(x, s3)

    block = [(WIDTH,), (WIDTH, HIDDEN), (HIDDEN, WIDTH)]
    names = ("s1", "up1", "down1", "s2", "up2", "down2", "s3")
    kinds = [("param", n) for n in names] + [("input", "x")]
    shapes = [*block, *block, (WIDTH,), (STREAM_TOKENS, WIDTH)]
    graph = _graph(f, shapes, kinds).for_platform("gpu")
    return graph, _product_of(graph, "down1"), _product_of(graph, "down2")


def test_a_residual_stream_cut_over_its_width_holds_split_partials():
    """The stream's width cut 4 ways, each down projection (256 tokens by
    64 over 512 on a device) split in 8: the norm after each sum reduces a
    cut dim, so XLA:GPU fuses the second sum's 8 float32 partials into its
    readers and holds them where the sum would be kept
    (`tests/planner/test_kept_partials_gpu.py` reads it off the program);
    the first sum, which adds the stream's input, it writes out."""
    graph, down1, down2 = residual_stream()
    kept = frozenset(k.tensor for k in graph.residuals)
    assert {down1, down2} <= kept  # each sum is recomputed from its product
    width = graph.param("s1").dim_classes[0]
    hidden = {graph.param(w).dim_classes[1]: "model" for w in ("up1", "up2")}
    sizes = {"model": 4}
    assert split_parts(HIDDEN, STREAM_TOKENS, WIDTH / 4) == 8

    def factors(class_axis, kept=kept):
        cut = Assignment(class_axis=class_axis)
        products = activation_products(graph, cut, sizes)
        return norm_read_partials_factors(graph, products, cut, sizes, kept)

    assert factors({width: "model"}) == {down2: 8.0}
    # Kept as the sum itself (the view that stops at a layer call's end).
    (total,) = [s for out, s, _, _ in graph.norm_read_products if out == down2]
    assert factors({width: "model"}, frozenset({total})) == {total: 8.0}
    # The norms reduce on one device: each sum is written out.
    assert factors({}) == {}
    # The hidden dim cut too: each down projection's output is all-reduced.
    assert factors({width: "model", **hidden}) == {}


RELU_WIDE = 2 * HIDDEN


def relu_dense():
    """A ReLU of a scaled input's product (64 tokens, 256 -> `RELU_WIDE`)
    read by another product: the graph as XLA:GPU keeps residuals, and the
    ReLU's output."""

    def f(scale, w, down, x):
        return jax.nn.relu((x * scale) @ w) @ down

    wide = RELU_WIDE
    shapes = [(WIDTH,), (WIDTH, wide), (wide, 16), (TOKENS, WIDTH)]
    kinds = [("param", n) for n in ("scale", "w", "down")] + [("input", "x")]
    graph = _graph(f, shapes, kinds).for_platform("gpu")
    down = _product_of(graph, "down")
    (read,) = [lhs for out, lhs, _, _ in graph.products if out == down]
    return graph, read


def test_a_relu_keeps_eight_partials():
    """A ReLU Dense cut 4 ways over its features (64 tokens by 256 over
    256 on a device), split in 8 as the gated GELU above: only cheap work
    reads the sum (`max`), so XLA:GPU keeps the 8 partials
    (`CHEAPLY_READ_KEPT_PARTS_LIMIT`: the zoo's OPT on 2x4), and the ReLU's
    output beside them (the next product's weight gradient reads it)."""

    graph, read = relu_dense()
    assert not set(graph.expensively_read_products) & {_product_of(graph, "w")}
    features = graph.param("w").dim_classes[1]
    cut = Assignment(class_axis={features: "model"})
    assert split_parts(WIDTH, TOKENS, RELU_WIDE / 4) == 8
    products = activation_products(graph, cut, {"model": 4})
    assert kept_partials_factors(graph, products, frozenset({read})) == {read: 9.0}


def attention_scores(heads_by_product: bool):
    """A query and a key of 8 heads of 32 made from one scaled input, their
    scores' softmax: each by a product whose weight has the heads' two dims
    (`heads_by_product`, KerasHub's `EinsumDense`), or by a product of 256
    features whose biased output is reshaped into the heads."""
    heads, head = 8, WIDTH // 8

    def f(scale, wq, bq, wk, bk, x):
        h = x * scale
        if heads_by_product:
            q = jnp.einsum("tc,chd->thd", h, wq) + bq
            k = jnp.einsum("tc,chd->thd", h, wk) + bk
        else:
            q = (h @ wq + bq).reshape(TOKENS, heads, head)
            k = (h @ wk + bk).reshape(TOKENS, heads, head)
        return jnp.sum(jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k), axis=-1))

    weight = (WIDTH, heads, head) if heads_by_product else (WIDTH, WIDTH)
    bias = (heads, head) if heads_by_product else (WIDTH,)
    shapes = [(WIDTH,), weight, bias, weight, bias, (TOKENS, WIDTH)]
    kinds = [("param", n) for n in ("scale", "wq", "bq", "wk", "bk")]
    return _graph(f, shapes, [*kinds, ("input", "x")]).for_platform("gpu")


@pytest.mark.parametrize("heads_by_product", [False, True])
def test_heads_a_product_makes_keep_no_partials(heads_by_product):
    """The merged query-key product (64 tokens by 512 over 256, split in
    4): where its outputs are reshaped into heads the backward pass keeps
    the partials (the zoo's subclassed model), where the product makes the
    heads itself XLA:GPU materialises them and frees the partials (GPT-2,
    OPT and BERT on 2x4; `tests/planner/test_kept_partials_gpu.py`)."""
    graph = attention_scores(heads_by_product)
    kept = frozenset(k.tensor for k in graph.residuals)
    assert split_parts(WIDTH, TOKENS, 2 * WIDTH) == 4
    factors = kept_partials_factors(graph, activation_products(graph, UNCUT, {}), kept)
    assert bool(factors) != heads_by_product, factors


def test_a_merged_weight_gradient_holds_every_member_s_partials():
    """A query, key and value reading one input of 1024 tokens: their
    weight gradients are one product (256 by 768 over 1024 tokens, split
    in 4), whose partials hold all three kernels' at once."""

    def f(wq, wk, wv, x):
        return jnp.sum((x @ wq) * (x @ wk) + x @ wv)

    tokens = 1024
    shapes = [*[(WIDTH, WIDTH)] * 3, (tokens, WIDTH)]
    kinds = [("param", n) for n in ("wq", "wk", "wv")] + [("input", "x")]
    graph = _graph(f, shapes, kinds)
    parts = split_parts(tokens, WIDTH, 3 * WIDTH)
    assert parts == 4
    share = 4.0 * parts * WIDTH * WIDTH  # one kernel's part of the partials
    weights = [graph.param(n).id for n in ("wq", "wk", "wv")]
    merged = merged_split_gradient_bytes(graph, UNCUT, {})
    assert merged == dict.fromkeys(weights, 3 * share)


def test_input_gradient_partials_of_three_projections():
    """A query, key and value reading one input (64 x 256): each input
    gradient contracts 256 features into 64 x 256, split in 8, so 7 more
    buffers of the input's size each (XLA:GPU on 8x1 makes `f32[8,64,256]`
    for each and sums all three in one fusion)."""

    def f(scale, wq, wk, wv, x):
        h = x * scale
        return jnp.sum((h @ wq) * (h @ wk) + h @ wv)

    shapes = [(WIDTH,), *[(WIDTH, WIDTH)] * 3, (TOKENS, WIDTH)]
    kinds = [("param", n) for n in ("scale", "wq", "wk", "wv")] + [("input", "x")]
    graph = _graph(f, shapes, kinds)
    (h,) = {
        lhs
        for _, lhs, _, _ in graph.products
        if graph.tensors[lhs].kind == "activation"
    }
    assert split_parts(WIDTH, TOKENS, WIDTH) == 8
    assert input_gradient_partials(graph, activation_products(graph, UNCUT, {})) == {
        h: 3 * 7
    }


def test_a_tanh_of_a_product_is_an_image_the_backward_pass_needs():
    """tanh's derivative reads its output, which XLA:GPU computes again
    from the product's partials in the backward fusion (the zoo's tied
    model on 2x4): the biased product's tanh is an image, the product
    needed; a product a norm-like reduction reads is not fused."""

    def f(scale, bias, w, head, x):
        return jnp.tanh((x * scale) @ w + bias) @ head

    wide = 2 * HIDDEN  # 64 tokens by 1024 over 256: split in 4
    shapes = [(WIDTH,), (wide,), (WIDTH, wide), (wide, 16), (TOKENS, WIDTH)]
    names = ("scale", "bias", "w", "head")
    kinds = [("param", n) for n in names] + [("input", "x")]
    graph = _graph(f, shapes, kinds)
    product = _product_of(graph, "w")
    ((images, needed),) = [
        (images, needed)
        for out, images, needed in graph.fused_products
        if out == product
    ]
    assert needed
    assert len(images) == 2  # the bias added, then its tanh
    (tanh,) = [t for t in images if t in {lhs for _, lhs, _, _ in graph.products}]
    assert kept_partials_factors(
        graph, activation_products(graph, UNCUT, {}), frozenset({tanh})
    ) == {tanh: 5.0}
    # Four float32 partials for the tanh's derivative, and the value (their
    # sum) for the head's weight gradient, which reads it.
    assert split_parts(WIDTH, TOKENS, wide) == 4


def test_a_relu_held_as_partials_keeps_no_mask():
    """A ReLU of a product XLA:GPU splits in 4, read by another product:
    the backward pass keeps the 4 float32 partials (the ReLU's derivative
    computes its mask from them again) and the ReLU's output (the next
    product's weight gradient reads it), not the mask the graph records
    beside the output (the zoo's subclassed model on 2x4: no mask buffer
    in XLA:GPU's program)."""

    graph, read = relu_dense()
    kept = {(k.tensor, k.scale) for k in graph.residuals}
    assert {(read, 1.0), (read, 0.25)} <= kept  # the output and its mask
    products = activation_products(graph, UNCUT, {})
    assert kept_partials_factors(graph, products, frozenset({read})) == {read: 5.0}
    activations, _, _ = accelerator_peak(graph, UNCUT, {}, frozenset())
    output_bytes, scaled_input = 4 * TOKENS * RELU_WIDE, 4 * TOKENS * WIDTH
    assert activations == 5 * output_bytes + scaled_input


def test_partials_made_by_names_the_reading_products():
    """The up projection's output (64 x 512) is read by the down one,
    whose input gradient contracts 256 features into 64 x 512: split, so
    the down product's output names where the partials are made."""

    def f(up, down, x):
        return jnp.tanh(x @ up) @ down

    shapes = [(WIDTH, HIDDEN), (HIDDEN, WIDTH), (TOKENS, WIDTH)]
    kinds = [("param", "up"), ("param", "down"), ("input", "x")]
    graph = _graph(f, shapes, kinds)
    down = _product_of(graph, "down")
    (read,) = [lhs for out, lhs, _, _ in graph.products if out == down]
    products = activation_products(graph, UNCUT, {})
    assert split_parts(WIDTH, TOKENS, HIDDEN) > 1
    assert partials_made_by(graph, products) == {read: (down,)}
    assert partials_made_by(graph, []) == {}  # no product read: none


def test_split_sums_of_several_products_name_the_gated_input_only():
    """The gated block's scaled input is read by the gate and the up
    projection, whose input gradients contract 512 features into 64 x 256,
    split: that sum. An MLP whose activations one product each reads has
    split input gradients too, but no sum of several."""
    graph = gated(approximate=True)
    gate = _product_of(graph, "gate")
    (h,) = [lhs for out, lhs, _, _ in graph.products if out == gate]
    products = activation_products(graph, UNCUT, {})
    assert split_parts(HIDDEN, TOKENS, WIDTH) > 1
    assert split_sums_of_several_products(graph, products) == {h}

    def mlp(up, down, x):
        return jnp.tanh(x @ up) @ down

    shapes = [(WIDTH, HIDDEN), (HIDDEN, WIDTH), (TOKENS, WIDTH)]
    kinds = [("param", "up"), ("param", "down"), ("input", "x")]
    single = _graph(mlp, shapes, kinds)
    single_products = activation_products(single, UNCUT, {})
    assert input_gradient_partials(single, single_products)
    assert split_sums_of_several_products(single, single_products) == frozenset()


@pytest.mark.parametrize("tokens", [4096, 8192])
def test_no_partials_at_real_widths(tokens):
    """At Llama-3-8B widths no product is split: nothing extra is held."""
    assert split_parts(4096, tokens, 14336) == 1
    assert split_parts(14336, tokens, 4096) == 1
