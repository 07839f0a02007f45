import pytest
import torch

from aftlab.testing import assert_close


def test_assert_close_names_the_tensor_and_the_worst_element():
    with pytest.raises(
        AssertionError, match=r"grad_q: 1/3 elements out of tolerance.*worst at \(1,\)"
    ):
        assert_close("grad_q", torch.tensor([1.0, 2.5, 3.0]), torch.tensor([1.0, 2.0, 3.0]))


def test_assert_close_rejects_nan_and_shape_mismatch():
    with pytest.raises(AssertionError, match="y: 1 non-finite"):
        assert_close("y", torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]))
    with pytest.raises(AssertionError, match="shape"):
        assert_close("y", torch.zeros(2), torch.zeros(3))


def test_assert_close_passes_within_tolerance():
    assert_close("y", torch.tensor([1.0 + 1e-7]), torch.tensor([1.0], dtype=torch.float64))


def test_dtype_errors_are_both_value_and_type_errors():
    from aftlab._checks import DTypeError, check_compatible, check_tensor

    with pytest.raises(ValueError, match="'k' has dtype torch.float64 but 'q' has torch.float32"):
        check_compatible("op", {"q": torch.zeros(1), "k": torch.zeros(1, dtype=torch.float64)})
    with pytest.raises(
        TypeError, match="'x' must be a floating-point tensor, got dtype torch.int64"
    ):
        check_tensor("op", "x", torch.zeros(1, dtype=torch.long), floating=True)
    assert issubclass(DTypeError, ValueError) and issubclass(DTypeError, TypeError)


def test_decode_feeds_step_token_by_token_and_continues_from_a_state():
    from aftlab.testing import decode

    class Running:  # y_t = running sum of x, the state its count and sum
        def init_state(self, batch_size):
            return (0, torch.zeros(batch_size, 2))

        def step(self, x, state):
            n, s = state
            return s + x, (n + 1, s + x)

    x = torch.randn(3, 5, 2)
    y, state = decode(Running(), x[:, :2])
    y2, state = decode(Running(), x[:, 2:], state)
    assert state[0] == 5
    assert_close("decode", torch.cat([y, y2], 1), x.cumsum(1))
    assert decode(Running(), x[:, :0])[0].shape == (3, 0, 2)


def test_perturb_parameters_moves_every_parameter():
    from aftlab.testing import perturb_parameters

    m = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in m.parameters()]
    assert perturb_parameters(m) is m
    assert all((p != b).all() for p, b in zip(m.parameters(), before, strict=True))
