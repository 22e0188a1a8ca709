"""The `torch` trainer backend: plain PyTorch on CPU or GPUs, for laptops, tests and small
models."""
