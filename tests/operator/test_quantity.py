"""Memory quantities the operator adds the sidecars' memory to, and writes back."""

from __future__ import annotations

import pytest

from rljob_operator.quantity import mebibytes, memory_bytes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("quantity", "nbytes"), [
    ("64Gi", 64 << 30), ("512Mi", 512 << 20), ("1.5Gi", 3 << 29), ("1G", 10**9),
    ("128974848", 128974848), (1000, 1000), ("129e6", None), ("1500m", 2), ("2Ti", 2 << 40),
])
def test_memory_quantities_in_bytes(quantity: int | str, nbytes: int | None) -> None:
    if nbytes is None:  # an exponent is valid Kubernetes but not what rljob accepts
        with pytest.raises(ValueError, match="is not a memory quantity"):
            memory_bytes(quantity)
    else:
        assert memory_bytes(quantity) == nbytes


def test_a_suffix_kubernetes_does_not_know_is_refused_with_an_example() -> None:
    with pytest.raises(ValueError, match=r"'64GB' is not a memory quantity \(e.g. 64Gi"):
        memory_bytes("64GB")


@pytest.mark.parametrize(("nbytes", "written"), [
    (5 << 30, "5Gi"), ((5 << 30) + 1, "5121Mi"), (1536 << 20, "1536Mi"), (2 << 40, "2Ti"),
    (10**9, "954Mi"),
])
def test_written_back_as_the_api_server_writes_it(nbytes: int, written: str) -> None:
    assert mebibytes(nbytes) == written
