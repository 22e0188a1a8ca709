"""Which GPU a CUDA handle is opened on: the receiver's own index of the GPU it names."""

from __future__ import annotations

import pytest

from rljob.weightsync.wire import device_index

pytestmark = pytest.mark.unit

SEEN = ["8f0c-a", "8f0c-b"]  # the GPUs a receiver sees, in its numbering


def test_a_uuid_is_opened_at_the_receivers_index_of_that_gpu() -> None:
    assert device_index("8f0c-b", SEEN) == 1
    assert device_index("8f0c-a", SEEN) == 0


def test_an_index_from_an_unpatched_sender_is_kept() -> None:
    assert device_index(1, SEEN) == 1


def test_a_gpu_the_receiver_does_not_see_is_refused_naming_both_sides() -> None:
    with pytest.raises(ValueError, match="names GPU 8f0c-z, which this process does not see "
                       r"\(it sees 8f0c-a, 8f0c-b\)"):
        device_index("8f0c-z", SEEN)
    with pytest.raises(ValueError, match="it sees no GPU"):
        device_index("8f0c-a", [])
