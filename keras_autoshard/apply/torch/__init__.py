"""PyTorch backend: plans applied as DTensor placements over `torch.distributed`.

Planning runs the same JAX planner in a subprocess (`planning.py`); every
rank receives the same `ShardingPlan` and turns each variable into a DTensor
holding only its shard (`sharded_state.py`). DTensor's sharding propagation
inserts the collectives, as the XLA partitioner does on JAX.
"""
