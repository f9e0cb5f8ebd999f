"""A Keras model (torch backend) whose variables are DTensor shards.

Each rank feeds its own slice of the global batch (split over the plan's
batch axis; ranks along the other axes feed the same slice). Inputs enter as
DTensors sharded on the batch axis; outputs leave as plain tensors of the
global batch, identical on every rank, and targets are gathered the same way,
so the loss is the global-batch loss on every rank. DTensor's autograd then
all-reduces replicated parameters' gradients over the data axis and inserts
the Megatron all-reduces over the model axis. Keras's own data parallelism
(keras 3.16 wraps a model in `DistributedDataParallel` under a process group,
and sums metric variables over the ranks) is turned off for these models, and
on keras 3.16, which computes attention on the local blocks of its inputs,
every layer's output keeps its batch cut over the batch axis only.
"""

from __future__ import annotations

import contextlib
import functools

import keras
from keras import tree

from keras_autoshard.apply.torch.dtensor_layout import (
    batch_cut_on_batch_axis,
    batch_mesh_dims,
    batch_placements,
)
from keras_autoshard.apply.torch.sharded_state import (
    RankStateBytes,
    rank_state_bytes,
    shard_model_variables,
    shard_optimizer_variables,
)
from keras_autoshard.compat import keras_private
from keras_autoshard.io.torch.weights_h5 import load_weights_local
from keras_autoshard.plans.sharding_plan import ShardingPlan


@keras_private.torch_trainer_per_rank
class TorchShardedModel(keras.Model):
    """Run a built Keras model sharded by a plan across torch ranks.

    Args:
        model: A built Keras model (torch backend), the same on every rank.
        plan: Its `ShardingPlan` (e.g. from `plan_for_torch`).
        device_mesh: The torch `DeviceMesh` of `plan.mesh`.

    Example:

    ```python
    # torchrun --nproc-per-node 4 train.py
    plan = plan_for_torch(model, MeshSpec((2, 2), ("batch", "model")), x)
    sharded = TorchShardedModel(model, plan, torch_device_mesh(plan.mesh))
    sharded.compile(optimizer="adam", loss="mse")
    sharded.fit(x_of_this_rank, y_of_this_rank)
    ```
    """

    def __init__(self, model: keras.Model, plan: ShardingPlan, device_mesh, **kwargs):
        super().__init__(**kwargs)
        self.inner = model
        self._sharding = None
        self._output_hooks = ()
        if plan is not None:
            self._shard(plan, device_mesh)

    # ------------------------------------------------------------ sharding
    def _shard(
        self, plan: ShardingPlan, device_mesh, init_seed: int = 0, weights=None
    ) -> None:
        """Shard the variables by `plan`; then fill them from `weights` (a
        weights file, each rank reading its blocks) if given."""
        shard_model_variables(
            self.inner,
            plan,
            device_mesh,
            init_seed=init_seed,
            initialise=weights is None,
        )
        if weights is not None:
            load_weights_local(self.inner, weights)
        self._sharding = (plan, device_mesh)
        self._cut_layer_outputs_alike(plan)
        if getattr(self, "optimizer", None) is not None and self.optimizer.built:
            shard_optimizer_variables(self)

    def _cut_layer_outputs_alike(self, plan: ShardingPlan) -> None:
        """Where Keras computes attention on local blocks (keras 3.16), every
        layer of the model hands on its output with the batch cut over the
        batch axis only (`batch_cut_on_batch_axis`), so that attention's
        query, key, value and mask are cut alike."""
        for handle in self._output_hooks:
            handle.remove()
        self._output_hooks = ()
        if not keras_private.torch_attention_on_local_blocks():
            return
        batch_dims = batch_mesh_dims(plan.mesh, plan.batch_axis)
        hook = functools.partial(_outputs_cut_alike, batch_dims)
        self._output_hooks = tuple(
            layer.register_forward_hook(hook)
            for layer in keras_private.all_layers(self.inner)
        )

    @property
    def plan(self) -> ShardingPlan:
        if self._sharding is None:
            raise ValueError("The model is not sharded yet: it has no plan.")
        return self._sharding[0]

    def state_bytes(self) -> RankStateBytes:
        """Bytes of parameters and optimizer state held by this rank."""
        return rank_state_bytes(self, self.plan)

    # ------------------------------------------------------------- calling
    def call(self, inputs, training=None):
        if self._sharding is None or _is_symbolic(inputs):
            return self.inner(inputs, training=training)
        with _implicit_replication():
            outputs = self.inner(self._global_inputs(inputs), training=training)
        return tree.map_structure(_to_replicated_plain, outputs)

    def _global_inputs(self, inputs):
        import torch
        from torch.distributed.tensor import DTensor

        plan, mesh = self._sharding
        placements = batch_placements(plan.mesh, plan.batch_axis)

        def to_dtensor(value):
            if value is None or isinstance(value, DTensor):
                return value
            return DTensor.from_local(torch.as_tensor(value), mesh, placements)

        return tree.map_structure(to_dtensor, inputs)

    def gather_batch(self, values):
        """The global batch of per-rank `values` (targets, sample weights)."""
        if self._sharding is None:
            return values
        return tree.map_structure(_to_replicated_plain, self._global_inputs(values))

    def _symbolic_build(self, iterator=None, data_batch=None):
        keras_private.symbolic_build(super(), data_batch=data_batch, iterator=iterator)
        if self._sharding is not None and self.optimizer is not None:
            shard_optimizer_variables(self)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with _implicit_replication():
            return super().train_step(
                (x, self.gather_batch(y), self.gather_batch(sample_weight))
            )

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with _implicit_replication():
            return super().test_step(
                (x, self.gather_batch(y), self.gather_batch(sample_weight))
            )


def _outputs_cut_alike(batch_dims, layer, args, outputs):
    """Forward hook: `outputs` with `batch_cut_on_batch_axis`, or `None`
    (kept as they are) when no output changes."""
    flat = tree.flatten(outputs)
    cut = [batch_cut_on_batch_axis(value, batch_dims) for value in flat]
    if all(new is old for new, old in zip(cut, flat)):
        return None
    return tree.pack_sequence_as(outputs, cut)


def _to_replicated_plain(value):
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _is_symbolic(inputs) -> bool:
    return any(
        getattr(getattr(t, "device", None), "type", None) == "meta"
        or isinstance(t, keras.KerasTensor)
        for t in tree.flatten(inputs)
    )


@contextlib.contextmanager
def _implicit_replication():
    """Plain tensors act as replicated DTensors; attention runs on the math
    kernel (DTensor propagates fused CPU attention kernels op by op through
    their decomposition, hundreds of times slower)."""
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with implicit_replication(), sdpa_kernel([SDPBackend.MATH]):
        yield
