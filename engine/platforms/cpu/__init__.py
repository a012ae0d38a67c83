"""The CPU platform: every CPU-only fast path, behind one object the model runner calls.

What lives here:

- `matmul`, `matmul_tuning`: the matmul backends a Linear computes through (aten, oneDNN, MKL,
  panels) and the start-up measurement that picks a plan per machine (and the "auto" dtype).
- `glue`: the forward's elementwise glue (norms, rotary, SiLU-and-mul) as C++ ops, eager torch,
  or compiled by TorchInductor (one compiled set per dtype).
- `decode_stack`: a decode step's decoder layers in one C++ call.
- `greedy_screen`: greedy tokens of a float32 LM head at bfloat16 cost.
- `prefill_choice`: whether prefill chunks run faster through torch's SDPA than the C++ kernel.
- `runtime`: the process's thread runtime (OpenMP, allocator, pinning); `machine_cache`: the
  per-machine cache of every start-up measurement above.
- `platform`: `CpuPlatform`, which ties them together.

How the runner calls it (engine.platforms.platform_for gives it on the CPU): `auto_dtype()`
answers EngineConfig.dtype "auto"; `prepare(model, dtype)` runs once after loading (tunes the
matmul plan and packs the weights, builds the greedy screen, compiles and measures the glue,
prepares the decode stacks); then each step's forward runs inside `step(num_tokens,
decode_only)`, which picks that step's glue. `greedy_screen` and `extra_weight_bytes` are what
the runner reads back.

Nothing is imported here: engine.layers imports `matmul` from this package while it loads.
"""
