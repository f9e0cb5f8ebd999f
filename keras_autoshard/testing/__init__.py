"""What the tests, the benchmarks and the command line build models and check
plans with: a stage above the pipeline that uses it, never used by it.

- `zoo`: the acceptance models (KerasHub backbones from small configs, an
  MLP, a CNN, a subclassed and a tied-embedding model) and their batches;
  `hub_backbones`: every exported KerasHub backbone class at a small config.
- `compiled`: the plan → `PlanDistribution` → `compile_as_planned` →
  `inspect_compiled` sequence (`compiled_as_planned`), once.
- `parity`: relative error of a sharded result against one device's.
- `reference_plans`: the hand-written Megatron plans and KerasHub's own
  layout map, the baselines the planner is judged against.
- `generate`: a KerasHub CausalLM's `generate_step` planned and compiled.
- `model_coverage`, `moe_backbones`, `real_size_models`, `reduced_depth`:
  the checks and models of the coverage, MoE and real-size measurements.
- `markdown`: named sections of BENCHMARKS.md and Markdown tables.

Nothing here is public API; only the command line, above it, imports it.
"""
