"""The `megatron` trainer backend: megatron-core GPTModel trained with the RL losses.

Only `shape` and `tensor_layout` import without megatron-core; the other modules need it (a GPU
machine with `pip install .[megatron]`).
"""
