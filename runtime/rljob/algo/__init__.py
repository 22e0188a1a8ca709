"""RL math shared by every trainer backend: log-probs, advantages, losses.

Backends (torch here, megatron elsewhere) hand in hidden states, the output-layer weight
and padded response tensors; nothing in this package knows about Ray or checkpoints.
"""
