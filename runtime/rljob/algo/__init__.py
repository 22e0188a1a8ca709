"""RL math shared by every trainer backend: advantages and losses.

Backends (`rljob.trainer.torch`, `rljob.trainer.megatron`) hand in padded response tensors
(log-probs from `rljob.kernels`, rewards, masks); nothing in this package knows about Ray,
models or checkpoints, so both backends give the same numbers for the same samples.
"""
