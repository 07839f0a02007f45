import pytest
import torch

from aftlab.testing import assert_close


def test_assert_close_names_the_tensor_and_the_worst_element():
    with pytest.raises(AssertionError, match=r"grad_q: 1/3 elements out of tolerance.*worst at \(1,\)"):
        assert_close("grad_q", torch.tensor([1.0, 2.5, 3.0]), torch.tensor([1.0, 2.0, 3.0]))


def test_assert_close_rejects_nan_and_shape_mismatch():
    with pytest.raises(AssertionError, match="y: 1 non-finite"):
        assert_close("y", torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]))
    with pytest.raises(AssertionError, match="shape"):
        assert_close("y", torch.zeros(2), torch.zeros(3))


def test_assert_close_passes_within_tolerance():
    assert_close("y", torch.tensor([1.0 + 1e-7]), torch.tensor([1.0], dtype=torch.float64))
