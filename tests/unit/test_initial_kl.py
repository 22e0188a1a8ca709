"""The step-0 check that the reference model is the initial policy."""

from __future__ import annotations

import pytest
import torch

from rljob.trainer.batch import INITIAL_KL_TOLERANCE, InitialKLMismatch, verify_initial_kl


def test_rounding_between_two_copies_of_the_same_weights_passes() -> None:
    old = torch.tensor([[-1.25, -0.5], [-2.0, -3.0]])
    # The gap measured on an H200 between Megatron's policy and reference in float32.
    verify_initial_kl(old, old + 4.8e-7)
    verify_initial_kl(old, old.clone())
    # A token both give no probability at all (-inf in both) is no gap.
    old[0, 1] = float("-inf")
    verify_initial_kl(old, old.clone())


@pytest.mark.parametrize("gap", [10 * INITIAL_KL_TOLERANCE, 0.3, float("nan")])
def test_a_reference_that_is_not_the_policy_is_refused(gap: float) -> None:
    old = torch.tensor([[-1.25, -0.5], [-2.0, -3.0]])
    ref = old.clone()
    ref[1, 0] += gap
    with pytest.raises(InitialKLMismatch, match="differ at step 0"):
        verify_initial_kl(old, ref)
