"""Every log-prob implementation: chunked response-only log-probs (`logprobs`), the
vocabulary-parallel tiles (`logprobs_vocab_parallel`, also the CPU reference), and the fused
Triton kernels (`logprobs_fused`, `logprobs_tma`) with their running statistics."""
