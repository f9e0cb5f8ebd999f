"""The axis graph: which tensor dimensions must be sharded alike, and what it costs.

An *axis class* is a set of tensor dimensions that must carry the same sharding
(they are the same logical axis seen through different ops). The graph lists
every tensor of a traced forward pass, the class of each of its dimensions, and
the communication that sharding a class on a mesh axis implies:

- `CommEvent`: an all-reduce of one tensor, forward (a contraction or reduction
  over a sharded class leaves partial sums) or backward (the gradient of an
  operand is partial over a sharded class it was combined with).
- `SliceEdge`: a class that may be sharded where another is not (a reshape
  merge, a slice, a repeat), at the price of a backward all-reduce.

This module is plain data and does not import any backend; the JAX walker that
fills it lives in `keras_autoshard.graph.builder`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections import Counter
from collections.abc import Iterable

from keras_autoshard.errors import DimSizeMismatchError  # noqa: F401

TENSOR_KINDS = ("param", "state", "input", "activation", "constant")
# The reason of a `SliceEdge` between equal parts and their join.
JOINED = "joined dim of"
EVENT_KINDS = ("contract", "reduce", "gather", "broadcast_grad")
PHASES = ("forward", "backward")

# Buffers of its operand's size a max or min pooling's backward pass holds
# at once on XLA:CPU (`AxisGraph.workspaces`).
CPU_POOLING_BUFFERS = 6.0


@dataclasses.dataclass(frozen=True)
class TensorNode:
    """One tensor of the traced forward pass.

    Args:
        id: Index of the tensor in `AxisGraph.tensors`.
        shape: Global shape.
        itemsize: Bytes per element.
        kind: `"param"`, `"state"`, `"input"`, `"activation"` or `"constant"`.
        name: Variable path for params and state, input name for inputs,
            `None` otherwise.
        dim_classes: Axis-class id per dimension, `None` for size-1 dims.
        requires_grad: Whether the tensor depends on a `"param"` tensor.
    """

    id: int
    shape: tuple[int, ...]
    itemsize: int
    kind: str
    name: str | None
    dim_classes: tuple[int | None, ...]
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        """Total size of the (unsharded) tensor in bytes."""
        return math.prod(self.shape) * self.itemsize


@dataclasses.dataclass(frozen=True)
class AxisClass:
    """A set of tensor dimensions that must carry the same sharding.

    Args:
        id: Index of the class in `AxisGraph.classes`.
        size: Size of every dimension in the class.
        unshardable_reason: Why the class may not be sharded, or `None`.
        dims: `(tensor_id, dim)` members, for explanations.
    """

    id: int
    size: int
    unshardable_reason: str | None
    dims: tuple[tuple[int, int], ...]

    @property
    def shardable(self) -> bool:
        return self.unshardable_reason is None


@dataclasses.dataclass(frozen=True)
class CommEvent:
    """Communication implied when any of `classes` is sharded on a mesh axis.

    If one of `classes` is sharded on mesh axis `a`, the step needs one
    all-reduce over `a` of `tensor`'s per-device bytes, `multiplicity` times.
    Backward events on the same tensor are already merged: the gradient of a
    tensor is the sum of its uses' contributions, all-reduced once.

    Args:
        kind: `"contract"` (dot/conv contracting dims, or the scatter-add of a
            gradient), `"reduce"` (reduce_sum/max/...), `"gather"` (an indexed
            operand dim: masked local lookup, then all-reduce) or
            `"broadcast_grad"` (the gradient of a broadcast operand).
        phase: `"forward"` or `"backward"`.
        classes: The triggering class ids.
        tensor: Id of the tensor whose bytes are all-reduced: the op output
            forward, the operand whose gradient is partial backward.
        multiplicity: How many times the op runs per step (scan length).
        primitive: The primitive(s) that imply the communication.
        uses: For a backward event merged from several uses of its tensor
            (a tied embedding's lookup and projection), each use's classes;
            empty for one use. XLA:CPU reduces each use's partial gradient
            of a parameter on its own (`AxisGraph.for_platform`).
    """

    kind: str
    phase: str
    classes: tuple[int, ...]
    tensor: int
    multiplicity: int
    primitive: str
    uses: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class GroupedConv:
    """A grouped (or depthwise) convolution's input, which the planner must
    lay out so that XLA computes its filter gradient right.

    XLA's SPMD partitioner (jax 0.10.2) sums the filter gradient of a
    convolution with `feature_group_count > 1` over every device when the
    input's batch (or spatial) dim is cut over only part of the mesh and the
    other mesh axes cut nothing of the input: on a 2x4 mesh with the batch on
    the first axis the gradient comes out 4 times too large. The search
    therefore requires that when any non-feature dim of `tensor` is cut,
    every mesh axis cuts some dim of it.

    Args:
        tensor: Id of the convolution's input tensor.
        feature_dim: Its feature (channel) dim.
        layer: The Keras layer path the convolution was traced in.
    """

    tensor: int
    feature_dim: int
    layer: str = ""


@dataclasses.dataclass(frozen=True)
class SliceEdge:
    """`target` may be sharded on mesh axes where `source` is not.

    Wherever `source` is sharded, `target` must be sharded the same way (the
    data layouts agree). Sharding `target` on an extra mesh axis is a free
    local slice forward and needs an all-reduce of `tensor`'s gradient
    backward. Made by reshape merges/splits (major factor), slices, pads,
    concatenation and repeats; a concatenation of equal parts or a split
    into them leaves the parts cuttable too (`joined`).

    Args:
        source: Class id of the operand dim.
        target: Class id of the result dim.
        tensor: Id of the operand tensor whose gradient is all-reduced.
        reason: What made the edge (`"repeat"` for a `jnp.repeat`, as of
            grouped key/value heads; `"reshape split"`, `"slice dim of
            slice"`, ...), for the plan's notes.
    """

    source: int
    target: int
    tensor: int
    reason: str = ""

    @property
    def joined(self) -> bool:
        """An edge between equal parts and their join (a concatenation of
        two batches, a split into halves): both ends may be cut over the
        same axis, each device's rows of the join then come from other
        devices' parts (XLA moves them), forward and backward."""
        return self.reason.startswith(JOINED)


@dataclasses.dataclass(frozen=True)
class Kept:
    """A tensor the backward pass keeps (a residual of automatic
    differentiation; see `graph/jaxpr/residuals.py`).

    Args:
        tensor: Its id (a view's residual is its source's).
        scale: Bytes kept per byte of the tensor (a boolean mask kept for a
            float tensor: 0.25).
        times: How many copies are kept (a loop body's residual: one per
            trip).
        layers: The top-level layers whose backward pass needs it (a
            rematerialized layer keeps none of its own).
    """

    tensor: int
    scale: float
    times: int
    layers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class AxisGraph:
    """Tensors, axis classes and communication of one traced forward pass.

    Args:
        tensors: Every tensor, indexed by id.
        classes: Every axis class, indexed by id.
        comm_events: Communication implied by sharding classes.
        slice_edges: Classes that may be sharded where another is not.
        unknown_primitives: `(primitive name, count)` of primitives the walker
            had no rule for; their dims were made unshardable.
        notes: Remarks a person should read (e.g. while loops with unknown
            trip counts).
        scope_outputs: `(scope, tensor ids)`: for each name scope of the
            trace (a Keras layer path), the output tensor of each call.
        grouped_convs: The inputs of grouped convolutions (see
            `GroupedConv`).
        residuals: The tensors the backward pass keeps (`Kept`).
        residuals_within_layers: The same with fusions kept within layer
            calls (the view of a program whose layers are rematerialized).
        accelerator_residuals: `residuals` as XLA:GPU (and TPU) fuse them:
            the second pass of a normalisation (the exponentials of a
            softmax, after its maximum) is recomputed from its first pass's
            input rather than materialised (`graph/fusion.py`).
        accelerator_residuals_within_layers: The same within layer calls.
        other_residual_bytes: Bytes kept that no tensor of the graph holds
            (intermediates of a derivative of another shape), counted whole.
        outputs: The forward pass's output tensor ids.
        poolings: `(operand, output)` of each max or min pooling: XLA:GPU
            forms the operand's gradient by scattering the output's into a
            zeroed buffer of the operand's size (`accelerator_peak`); XLA:CPU
            needs several buffers of that size at once (`workspaces`).
        tensor_layers: The top-level Keras layer whose call made each
            tensor ("" outside any layer; `graph/blocks.py`).
        layer_inputs: `(layer, tensor ids)`: the activations each top-level
            layer reads from outside its call (what a rematerialized call
            keeps).
        unread: Parameters no equation reads (a backbone's unused output
            table): their gradient is zero, which XLA folds into the
            update, keeping no buffer for it.
        param_readers: `(parameter id, layers)`: the top-level layers whose
            equations read each parameter ("" for equations outside any
            layer): its gradient exists once the backward pass reaches the
            last of them in call order.
        input_readers: `(input id, layers)`: the top-level layers whose
            equations read each input of the forward pass.
        key_values: `(key, value)` tensor ids of each attention, as a
            generation cache stores them (`graph/kv_cache.py`).
        matmul_operands: Tensor ids read by a matrix product
            (`dot_general`) or a convolution, as either operand.
        matmul_pairs: `(lhs, rhs)` tensor ids (the sources of views) of
            every `dot_general`: XLA:GPU merges the weight gradients of
            products that read one input into one product
            (`planner/split_k.py`).
        products: `(output, lhs, rhs, lhs free dims)` of every product with
            no batch dims (operands: the sources of views; the output's
            leading dims that many are the lhs's): XLA:GPU may split one
            over its contraction into partial results (`planner/split_k.py`).
        fused_products: `(output, images, needed)` of those `products`
            whose output only elementwise work reads: the values made from
            it by cheap elementwise work with smaller operands (a bias
            added), and whether the backward pass needs it or an image as
            it is. XLA:GPU fuses the sum of a split product's partial
            results into those readers, so where the backward pass keeps
            the output or an image it keeps the partials instead
            (`graph/fusion.py`'s `product_images`).
        expensively_read_products: Outputs of those `products` that the
            fusible work after them turns by an expensive elementwise
            primitive (a GELU's tanh; not a ReLU's `max`): XLA:GPU keeps
            fewer of their partial results (`planner/split_k.py`).
        norm_read_products: `(output, sum, reduced classes, chained)` of
            those `fused_products` whose one reader is a residual sum: the
            sum, the classes the reductions after it reduce (a norm's), and
            whether the sum adds another such sum. Where those classes are
            cut across devices, XLA:GPU fuses a chained sum's split
            partials into every reader rather than materialise it
            (`planner/split_k.norm_read_partials_factors`).
        casts: `(cast, source)` tensor ids: each parameter or activation
            converted to another precision, the shape kept (a parameter's
            bfloat16 cast under `mixed_bfloat16`, which a product then reads
            in its place; attention probabilities cast back to bfloat16);
            `param_casts` and `activation_casts` split them by source.
        relaid_operands: Operands of a matrix product that XLA copies into
            another layout before multiplying (`graph/jaxpr/contractions.py`:
            a product it rewrites to canonical form, whose transpose of the
            operand moves data): a `(heads, embed, head_dim)` kernel
            contracted over `embed`, or one read with its contracting dims
            listed out of their order.
        param_views: `(view, parameter)`: activations that hold a
            parameter's bytes relabelled (its transpose or reshape, a tied
            embedding's table read as the output projection).
        several_outputs: Layer paths some call of which returns more than
            one tensor (`graph/layer_calls.py`): Keras would lay them all
            out by the one layout it asks for the layer's output.
        inputs_made_in_step: The inputs are no batch the train step is fed
            but ones it makes (a model traced through its parts,
            `trace/parts.py`: latent vectors drawn, generated images), so
            no data layout reaches them.

    Example:

    ```python
    graph = build_axis_graph(closed_jaxpr, invar_kinds)
    print(graph.summary())
    kernel = graph.param("dense/kernel")
    hidden = graph.classes[kernel.dim_classes[1]]
    ```
    """

    tensors: tuple[TensorNode, ...]
    classes: tuple[AxisClass, ...]
    comm_events: tuple[CommEvent, ...]
    slice_edges: tuple[SliceEdge, ...]
    unknown_primitives: tuple[tuple[str, int], ...]
    notes: tuple[str, ...] = ()
    scope_outputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    grouped_convs: tuple[GroupedConv, ...] = ()
    residuals: tuple[Kept, ...] = ()
    residuals_within_layers: tuple[Kept, ...] = ()
    accelerator_residuals: tuple[Kept, ...] = ()
    accelerator_residuals_within_layers: tuple[Kept, ...] = ()
    other_residual_bytes: int = 0
    outputs: tuple[int, ...] = ()
    poolings: tuple[tuple[int, int], ...] = ()
    tensor_layers: tuple[str, ...] = ()
    layer_inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    unread: tuple[int, ...] = ()
    param_readers: tuple[tuple[int, tuple[str, ...]], ...] = ()
    input_readers: tuple[tuple[int, tuple[str, ...]], ...] = ()
    key_values: tuple[tuple[int, int], ...] = ()
    matmul_operands: tuple[int, ...] = ()
    matmul_pairs: tuple[tuple[int, int], ...] = ()
    products: tuple[tuple[int, int, int, int], ...] = ()
    fused_products: tuple[tuple[int, tuple[int, ...], bool], ...] = ()
    expensively_read_products: tuple[int, ...] = ()
    norm_read_products: tuple[tuple[int, int, tuple[int, ...], bool], ...] = ()
    casts: tuple[tuple[int, int], ...] = ()
    relaid_operands: tuple[int, ...] = ()
    param_views: tuple[tuple[int, int], ...] = ()
    several_outputs: tuple[str, ...] = ()
    inputs_made_in_step: bool = False

    def for_platform(self, platform: str) -> AxisGraph:
        """This graph as the compiler of `platform` keeps residuals: itself
        on `"cpu"` (XLA:CPU), with `accelerator_residuals` on `"gpu"` and
        `"tpu"`.

        Args:
            platform: `"cpu"`, `"gpu"` or `"tpu"`.

        Returns:
            An `AxisGraph`.
        """
        if platform == "cpu":
            return self._partials_reduced_apart()
        if not self.accelerator_residuals:
            return self
        return dataclasses.replace(
            self,
            residuals=self.accelerator_residuals,
            residuals_within_layers=self.accelerator_residuals_within_layers,
        )

    def _partials_reduced_apart(self) -> AxisGraph:
        """This graph with each parameter gradient summed from several
        uses reduced once per use: XLA:CPU all-reduces each use's partial
        gradient and adds them after (measured: a tied embedding's lookup
        and projection gradients, 512 KiB each, are two operands of the
        combined all-reduce of a data-parallel step, not their sum)."""
        split = []
        for event in self.comm_events:
            if not event.uses or self.tensors[event.tensor].kind != "param":
                split.append(event)
                continue
            split += [
                dataclasses.replace(event, classes=classes, uses=())
                for classes in event.uses
            ]
        if len(split) == len(self.comm_events):
            return self
        return dataclasses.replace(self, comm_events=tuple(split))

    @functools.cached_property
    def workspaces(self) -> tuple[tuple[int, float], ...]:
        """`(tensor id, factor)`: an operand whose equation's backward pass
        on XLA:CPU needs `factor` buffers of its size at once. A max or min
        pooling's gradient is lowered to reduce-windows over (value, index)
        pairs with index tensors of the operand's size (six such buffers
        measured on XLA:CPU)."""
        return tuple((operand, CPU_POOLING_BUFFERS) for operand, _ in self.poolings)

    @functools.cached_property
    def product_contractions(self) -> dict[int, tuple[int, ...]]:
        """Output id -> the classes each matrix product (`dot_general`)
        contracts, from its forward communication event; read-only."""
        return {
            event.tensor: event.classes
            for event in self.comm_events
            if event.kind == "contract"
            and event.phase == "forward"
            and event.primitive == "dot_general"
        }

    @functools.cached_property
    def param_casts(self) -> tuple[tuple[int, int], ...]:
        """`(cast, parameter)` of `casts`: parameters read in another
        precision."""
        return tuple(c for c in self.casts if self.tensors[c[1]].kind == "param")

    @functools.cached_property
    def narrowed_params(self) -> dict[int, float]:
        """Parameter id -> its cast's bytes per element over its own, for
        each parameter read through a narrowing cast (a float32 kernel read
        as bfloat16 under `mixed_bfloat16`); read-only."""
        factors: dict[int, float] = {}
        for cast, param in self.param_casts:
            ratio = self.tensors[cast].itemsize / self.tensors[param].itemsize
            if ratio < 1.0:
                factors[param] = ratio
        return factors

    @functools.cached_property
    def activation_casts(self) -> tuple[tuple[int, int], ...]:
        """`(cast, activation)` of `casts`: activations converted to another
        precision."""
        return tuple(c for c in self.casts if self.tensors[c[1]].kind == "activation")

    @functools.cached_property
    def matmul_operand_ids(self) -> frozenset[int]:
        """`matmul_operands` as a set."""
        return frozenset(self.matmul_operands)

    def params(self) -> list[TensorNode]:
        """The `"param"` tensors, in invar order."""
        return [t for t in self.tensors if t.kind == "param"]

    def param(self, name: str) -> TensorNode:
        """The `"param"` tensor whose variable path is `name`.

        Args:
            name: A variable path such as `"dense/kernel"`.

        Returns:
            The tensor node.

        Raises:
            KeyError: If no param has that path.
        """
        tensor = self.params_by_path.get(name)
        if tensor is None:
            raise KeyError(f"No param named {name!r} in the axis graph.")
        return tensor

    @functools.cached_property
    def params_by_path(self) -> dict[str, TensorNode]:
        """Variable path -> its `"param"` tensor (the first of that path in
        invar order); read-only."""
        by_path: dict[str, TensorNode] = {}
        for tensor in self.tensors:
            if tensor.kind == "param":
                by_path.setdefault(tensor.name, tensor)
        return by_path

    def layer_outputs(self, layer_path: str) -> tuple[int, ...]:
        """Ids of the output tensor of each call of the layer at `layer_path`.

        Args:
            layer_path: A Keras layer path such as `"decoder_block_0/attention"`.

        Returns:
            One tensor id per call, in call order (empty if never seen).
        """
        for scope, outputs in self.scope_outputs:
            if scope == layer_path:
                return outputs
        return ()

    def class_of(self, tensor_id: int, dim: int) -> int | None:
        """Class id of dimension `dim` of tensor `tensor_id` (`None`: size 1)."""
        return self.tensors[tensor_id].dim_classes[dim]

    def events_for(
        self, class_id: int, phase: str | None = None, kind: str | None = None
    ) -> list[CommEvent]:
        """Comm events triggered by `class_id`, optionally by phase and kind.

        Args:
            class_id: An axis-class id.
            phase: `"forward"`, `"backward"` or `None` for both.
            kind: An event kind or `None` for all.

        Returns:
            The matching events, in graph order.
        """
        return [
            event
            for event in self.comm_events
            if class_id in event.classes
            and (phase is None or event.phase == phase)
            and (kind is None or event.kind == kind)
        ]

    def conflicts(self) -> set[frozenset[int]]:
        """Pairs of classes that occur in one tensor (may not share a mesh axis).

        Returns:
            A set of two-element frozensets of class ids.
        """
        pairs: set[frozenset[int]] = set()
        for tensor in self.tensors:
            present = sorted({c for c in tensor.dim_classes if c is not None})
            for a, b in itertools.combinations(present, 2):
                pairs.add(frozenset((a, b)))
        return pairs

    def summary(self) -> str:
        """A human-readable overview of the graph."""
        lines = [self._summary_counts()]
        lines.extend(self._summary_events())
        lines.extend(self._summary_shardable_classes())
        if self.unknown_primitives:
            unknown = ", ".join(f"{n} x{c}" for n, c in self.unknown_primitives)
            lines.append(f"Unknown primitives (dims made unshardable): {unknown}")
        lines.extend(f"Note: {note}" for note in self.notes)
        return "\n".join(lines)

    def _summary_counts(self) -> str:
        kinds = Counter(t.kind for t in self.tensors)
        shardable = sum(1 for c in self.classes if c.shardable)
        kind_text = ", ".join(f"{k}={kinds[k]}" for k in TENSOR_KINDS if kinds[k])
        return (
            f"AxisGraph: {len(self.tensors)} tensors ({kind_text}); "
            f"{len(self.classes)} axis classes ({shardable} shardable); "
            f"{len(self.comm_events)} comm events; "
            f"{len(self.slice_edges)} slice edges"
        )

    def _summary_events(self) -> list[str]:
        counts = Counter((e.phase, e.kind) for e in self.comm_events)
        return [
            f"  {phase:8s} {kind:15s} {counts[phase, kind]}"
            for phase in PHASES
            for kind in EVENT_KINDS
            if counts[phase, kind]
        ]

    def _summary_shardable_classes(self) -> list[str]:
        lines = ["Shardable classes:"]
        for axis_class in self.classes:
            if axis_class.shardable:
                members = self._named_members(axis_class.dims)
                where = ", ".join(members[:4]) or "activations only"
                more = f" (+{len(members) - 4} more)" if len(members) > 4 else ""
                lines.append(
                    f"  class {axis_class.id} size {axis_class.size}: "
                    f"{where}{more}; {len(axis_class.dims)} dims"
                )
        return lines

    def _named_members(self, dims: Iterable[tuple[int, int]]) -> list[str]:
        """Params first, then state and inputs, as `name[dim]`."""
        order = {"param": 0, "state": 1, "input": 2}
        named = [(t, d) for t, d in dims if self.tensors[t].kind in order]
        named.sort(key=lambda td: order[self.tensors[td[0]].kind])
        return [f"{self.tensors[t].name}[{d}]" for t, d in named]
