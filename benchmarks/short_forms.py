"""The short form of each GPU benchmark (`benchmarks/*gpu*.py`): how hack/gpu-test runs it on a
GPU (seconds, not minutes), and how CI runs it without one (tests/unit/test_gpu_tier_smoke.py),
so that a change that breaks a benchmark fails CI rather than the next run on a GPU machine.
A GPU benchmark missing here fails that test. Standard library only: hack/gpu-test reads it
before anything else is installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ShortForm:
    gpu: tuple[str, ...]
    """Arguments on a GPU."""
    cpu: tuple[str, ...]
    """Arguments without one."""
    cpu_covers: str
    """What the CPU form runs, and what of the benchmark it leaves to the GPU."""
    figures: tuple[str, ...]
    """Starts of the lines worth repeating in hack/gpu-test's summary; the CPU form prints one
    of them too."""
    cpu_env: dict[str, str] = field(default_factory=dict)


SHORT_FORMS: dict[str, ShortForm] = {
    "weight_sync_ipc_gpu.py": ShortForm(
        gpu=("--size-gb", "0.5", "--reps", "3"),
        cpu=("--device", "cpu", "--size-gb", "0.01", "--tensor-mb", "1", "--bucket-mb", "4",
             "--reps", "1"),
        cpu_covers="the whole handoff through the engine stand-in and the product's client, "
                   "CPU tensors in place of CUDA IPC handles",
        figures=("CUDA IPC handoff", "ratio IPC handoff"),
    ),
    "logprobs_memory_gpu.py": ShortForm(
        gpu=("--smoke",),
        cpu=("--device", "cpu", "--smoke"),
        cpu_env={"TRITON_INTERPRET": "1"},
        cpu_covers="every method against the float64 reference, the fused kernels under "
                   "Triton's CPU interpreter; no memory peaks, no CUDA-only peers",
        figures=("fused:",),
    ),
    "megatron_step_gpu.py": ShortForm(
        gpu=("--smoke",),
        cpu=("--plan-only",),
        cpu_covers="arguments, model shape and FLOP count only (the plan): the step needs "
                   "megatron-core and CUDA",
        figures=("plan:", "RL step:"),
    ),
    "colocated_memory_gpu.py": ShortForm(
        gpu=("examples/tiny-megatron-gpu.yaml", "--steps", "2"),
        cpu=("examples/tiny-megatron-gpu.yaml", "--steps", "1"),
        cpu_covers="one colocated step with the torch trainer and the hf engine on the CPU "
                   "(megatron-core is not installed there); no device memory to read",
        figures=("the engine serves exactly", "anchor, same run"),
    ),
}
