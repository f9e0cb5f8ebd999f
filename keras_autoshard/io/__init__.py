"""Weight files and checkpoint formats: tensors in and out of files, knowing
no plan.

- `tensor_files`: read-only views of the tensors in HDF5 and safetensors
  files, read by hyperslab.
- `keras_weights_layout`: which `.weights.h5` dataset holds which variable
  (Keras's own saving traversal).
- `safetensors_writer`: one `.safetensors` file written one tensor at a time
  from every process of a job.
- `torch/`: the DTensor side (`dtensor_shards`: fill and gather a rank's
  shard; `weights_h5`: `.weights.h5` files saved and loaded across torch
  ranks).

`apply/` and `checkpoint/` build on this stage; errors are `CheckpointError`
(`keras_autoshard/errors.py`).
"""
