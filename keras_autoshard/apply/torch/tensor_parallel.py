"""`TensorParallel(..., distributed_backend="torch")`: one rank per device
under torchrun, `world_size` ranks per model replica, data parallelism over
the rest. Planned on the first batch with the same planner as JAX."""

from __future__ import annotations

import os
import types
from collections.abc import Mapping, Sequence
from typing import Any

import keras
from keras import tree

from keras_autoshard.apply.first_batch import first_batch_of
from keras_autoshard.apply.tensor_parallel import TensorParallel
from keras_autoshard.apply.tensor_parallel_setup import TensorParallelError
from keras_autoshard.apply.torch.abstract_build import (
    build_abstract,
    is_abstract_source,
)
from keras_autoshard.apply.torch.dtensor_layout import torch_device_mesh
from keras_autoshard.apply.torch.planning import plan_for_torch
from keras_autoshard.apply.torch.sharded_model import TorchShardedModel
from keras_autoshard.compat import keras_private
from keras_autoshard.io.keras_weights_layout import weight_file_entries
from keras_autoshard.io.safetensors_writer import (
    SAFETENSORS_SUFFIX,
    write_safetensors,
)
from keras_autoshard.io.torch.weights_h5 import (
    load_weights_local,
    save_weights_gathered,
)
from keras_autoshard.plans.mesh import DATA_AXIS, MODEL_AXIS
from keras_autoshard.plans.rules import Spec
from keras_autoshard.plans.sharding_plan import MeshSpec, ShardingPlan
from keras_autoshard.plans.units import optional_byte_size
from keras_autoshard.runtime.torch_processes import ensure_process_group


@keras.saving.register_keras_serializable(package="keras_autoshard")
class TorchTensorParallel(TensorParallel, TorchShardedModel):
    """The PyTorch side of `keras_autoshard.TensorParallel`.

    Args:
        model: A built Keras model (torch backend; every rank ends with rank
            0's weights, scattered), or what builds one without a full copy
            on any rank: a function building it from its configuration, a
            Keras config dict, or a local KerasHub preset directory. Those
            are built abstractly (shapes only, `abstract_build.py`) and each
            rank materialises only its shards, filled from `weights` (a
            preset's `model.weights.h5` by default) slice by slice, or from
            the variables' initializers (seeded by `init_seed`, the same on
            every rank).
        world_size: Ranks that share one model replica (tensor parallelism);
            `None` for all ranks. The other factor of the rank count is data
            parallelism.
        device_ids: `None`, or one id per rank (under torchrun each rank
            drives one device: `LOCAL_RANK`).
        distributed_backend: `"torch"` or `"auto"` (what `TensorParallel`
            dispatched on).
        sample_input: One batch of this rank's inputs, to plan now instead of
            on the first batch.
        memory_budget: Per-device bytes (a number, or a string such as
            `"16GiB"`) for parameters and optimizer state.
        rules: Regular expression on variable path → spec, pinned.
        plan: A ready `ShardingPlan` (e.g. made under JAX) or its dict,
            used as given.
        weights: A Keras `.weights.h5` file of the model (or a
            `.safetensors` file keyed as one, as `save_safetensors` writes),
            loaded once the model is sharded, each rank reading only its
            blocks. Other formats: `keras_autoshard.load_weights_sharded(tp,
            path)` after construction.
        init_seed: Seed of the initial values of a model built abstractly
            without `weights`.

    Example:

    ```python
    # KERAS_BACKEND=torch torchrun --nproc-per-node 4 train.py
    tp = keras_autoshard.TensorParallel(model, world_size=2,
                                        distributed_backend="torch")
    tp.compile(optimizer="adam", loss="mse")
    tp.fit(x_of_this_rank, y_of_this_rank)  # 2-way TP x 2-way data parallel

    # A large model: no rank ever holds more than its shards (+ one tensor).
    tp = keras_autoshard.TensorParallel("./llama_preset", world_size=4,
                                        distributed_backend="torch",
                                        sample_input=x_of_this_rank)
    ```
    """

    def __init__(
        self,
        model,
        world_size: int | None = None,
        device_ids: Sequence[str | int] | None = None,
        distributed_backend: str = "torch",
        sample_input=None,
        memory_budget: int | str | None = None,
        rules: Mapping[str, Spec] | None = None,
        plan: ShardingPlan | Mapping | None = None,
        weights: str | os.PathLike | None = None,
        init_seed: int = 0,
        **kwargs,
    ):
        import torch.distributed as dist

        ensure_process_group()
        ranks = dist.get_world_size()
        world_size = ranks if world_size is None else int(world_size)
        if world_size < 1 or world_size > ranks or ranks % world_size:
            raise TensorParallelError(
                f"world_size={world_size} must divide the {ranks} ranks torchrun "
                "started (the rest is data parallelism). Choose a divisor of "
                f"{ranks} or change --nproc-per-node."
            )
        if device_ids is not None and len(device_ids) != ranks:
            raise TensorParallelError(
                f"device_ids={list(device_ids)} names {len(device_ids)} devices but "
                f"torchrun started {ranks} ranks, one device each. Leave "
                "device_ids=None and choose devices with --nproc-per-node and "
                "CUDA_VISIBLE_DEVICES."
            )
        preset_weights = None
        if is_abstract_source(model):
            model, preset_weights = build_abstract(model)
        if not isinstance(model, keras.Model):
            raise TensorParallelError(
                "TensorParallel wraps a keras.Model, a function building one, a "
                f"Keras config dict or a preset directory; got {type(model).__name__}."
            )
        kwargs.setdefault("name", "tensor_parallel")
        super().__init__(model, None, None, **kwargs)
        self.wrapped_model = model
        self.world_size = world_size
        self.mesh = MeshSpec((ranks // world_size, world_size), (DATA_AXIS, MODEL_AXIS))
        self._memory_budget = optional_byte_size(memory_budget)
        self._rules = rules
        self._weights = os.fspath(weights) if weights is not None else preset_weights
        self._init_seed = int(init_seed)
        if isinstance(plan, Mapping):
            plan = ShardingPlan.from_dict(plan)
        if plan is not None:
            self._shard(plan, torch_device_mesh(plan.mesh))
        elif sample_input is not None:
            self.prepare(sample_input)

    @property
    def is_planned(self) -> bool:
        return self._sharding is not None

    def prepare(self, sample_input) -> ShardingPlan:
        """Plan from one batch of this rank's inputs and shard the model."""
        if self.is_planned:
            return self.plan
        if not self.inner.built:
            self.inner(sample_input)
        data_ways = self.mesh.axis_size(DATA_AXIS)
        global_batch = tree.map_structure(
            lambda t: types.SimpleNamespace(
                shape=(t.shape[0] * data_ways, *t.shape[1:]), dtype=t.dtype
            ),
            sample_input,
        )
        plan = plan_for_torch(
            self.inner,
            self.mesh,
            global_batch,
            memory_budget=self._memory_budget,
            rules=self._rules,
            # Each model copy is cut over `world_size` devices, as asked.
            batch_over_model_axes=False,
        )
        self._shard(plan, torch_device_mesh(plan.mesh))
        return plan

    def _shard(self, plan: ShardingPlan, device_mesh) -> None:
        super()._shard(
            plan, device_mesh, init_seed=self._init_seed, weights=self._weights
        )

    def _symbolic_build(self, iterator=None, data_batch=None):
        if not self.is_planned:
            batch = data_batch if data_batch is not None else first_batch_of(iterator)
            x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
            self.prepare(x)
        keras_private.symbolic_build(super(), data_batch=data_batch, iterator=iterator)

    def predict(self, x, batch_size=None, *args, **kwargs):
        if not self.is_planned:
            rows = batch_size or 32
            self.prepare(tree.map_structure(lambda t: t[:rows], x))
        return super().predict(x, batch_size, *args, **kwargs)

    def predict_on_batch(self, x):
        self.prepare(x)
        return super().predict_on_batch(x)

    # --------------------------------------------------------- serialization
    def get_config(self) -> dict[str, Any]:
        """The wrapped model's config, the mesh and, once planned, the plan:
        `from_config` rebuilds it abstractly (no full copy) and sharded as
        saved, ready for `restore_checkpoint` or `load_weights`."""
        config = {
            "model": keras.saving.serialize_keras_object(self.wrapped_model),
            "name": self.name,
            "world_size": self.world_size,
            "distributed_backend": "torch",
            "memory_budget": self._memory_budget,
            "rules": {k: list(v) for k, v in (self._rules or {}).items()} or None,
            "init_seed": self._init_seed,
        }
        if self.is_planned:
            config["plan"] = self.plan.to_dict()
        return config

    # ------------------------------------------------------------- weights
    def save_weights(self, filepath, overwrite: bool = True, max_shard_size=None):
        """Write the wrapped model's Keras `.weights.h5` file (which plain
        Keras loads on one process, any backend), or, for a path ending in
        `.safetensors`, a safetensors file of its weights (keyed as the
        `.weights.h5` datasets; `load_weights_sharded` reads it on any
        backend). Every rank calls it with the same path; whole tensors are
        gathered one at a time and rank 0 writes them."""
        if max_shard_size is not None:
            raise TensorParallelError(
                "save_weights(max_shard_size=...) is not supported under the "
                "torch backend; save one .weights.h5 file, or use "
                "keras_autoshard.save_checkpoint for per-rank shards."
            )
        if not overwrite and os.path.exists(filepath):
            raise TensorParallelError(
                f"{filepath} exists and overwrite=False; pass overwrite=True or "
                "another path."
            )
        if os.fspath(filepath).endswith(SAFETENSORS_SUFFIX):
            write_safetensors(weight_file_entries(self.wrapped_model), filepath)
        else:
            save_weights_gathered(self.wrapped_model, filepath)

    def load_weights(self, filepath, skip_mismatch: bool = False, **kwargs):
        """Load a Keras `.weights.h5` file of the wrapped model (saved on any
        backend), each rank reading only the blocks of its shards."""
        if skip_mismatch or kwargs:
            raise TensorParallelError(
                "load_weights under the torch backend loads every variable or "
                "raises; skip_mismatch and other options are not supported. "
                "Use keras_autoshard.load_weights_sharded(..., name_map=...) to "
                "load part of a file."
            )
        load_weights_local(self.wrapped_model, filepath)
