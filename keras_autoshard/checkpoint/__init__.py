"""Checkpoint I/O that reads and writes each device's slice only.

Modules, one job each:

- `sharded_load`: load `.weights.h5`, `.keras`, safetensors files and KerasHub
  preset directories into a sharded model, slice by slice.
- `orbax_save` and `orbax_restore`: save and restore sharded weights and
  optimizer state with Orbax (plan and model config stored alongside), onto
  any mesh; `orbax_restore` also rebuilds a model from its stored config.
  `orbax_record`: what a step holds besides the arrays, and Orbax's API.
- `orbax_callback`: `ShardedOrbaxCheckpoint`, Keras's `OrbaxCheckpoint`
  callback with metadata, data-iterator state and the plan added.
- `torch_dcp`: the same save and restore on the PyTorch backend, with
  torch.distributed.checkpoint; `torch_callback`: its callback,
  `ShardedTorchCheckpoint`.
- `steps`: which steps of a checkpoint directory are complete.

Tensor files, the `.weights.h5` layout and DTensor shards are `io/`, the
stage below. Errors are `CheckpointError` (`keras_autoshard/errors.py`).
"""
