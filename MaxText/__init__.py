"""A MaxText-style decoder-LLM trainer on JAX/flax, with MPMD pipeline parallelism via jaxpp.

Data flows one way: `config` -> `devices`/`sharding` (mesh) -> `model` -> `train_step` -> `train`
(the loop) -> checkpoints / `metrics`.
"""
