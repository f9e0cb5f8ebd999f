"""Checkpoint I/O that reads and writes each device's slice only.

Modules, one job each:

- `errors`: `CheckpointError`, raised for anything that would otherwise load
  silently wrong.
- `keras_layout`: which `.weights.h5` dataset (`layers/<name>/vars/<i>`) holds
  which model variable, by Keras's own saving traversal.
- `tensor_files`: read-only views of tensors stored in HDF5 and safetensors
  files, read by hyperslab.
- `sharded_load`: load `.weights.h5`, `.keras`, safetensors files and KerasHub
  preset directories into a sharded model, slice by slice.
- `orbax_io`: save and restore sharded weights and optimizer state with Orbax
  (plan and model config stored alongside), onto any mesh.
- `orbax_callback`: `ShardedOrbaxCheckpoint`, Keras's `OrbaxCheckpoint`
  callback with metadata, data-iterator state and the plan added.
"""
