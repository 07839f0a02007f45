import torch

from aftlab.ops.scan import stable_prefix_average_reference
from aftlab.testing import assert_close


def _direct(k, v, decay, reverse):
    B, T, d = k.shape
    L = torch.empty_like(k)
    A = torch.empty_like(v)
    for t in range(T):
        idx = range(t, T) if reverse else range(t + 1)
        terms = torch.stack([k[:, s] - abs(t - s) * decay for s in idx], 1)
        L[:, t] = torch.logsumexp(terms, 1)
        w = torch.softmax(terms, 1)
        A[:, t] = (w * v[:, list(idx)]).sum(1)
    return L, A


def test_reference_recurrence_matches_direct_sums():
    k = torch.randn(2, 7, 3, dtype=torch.float64) * 30
    v = torch.randn(2, 7, 3, dtype=torch.float64)
    decay = torch.rand(3, dtype=torch.float64)
    for reverse in (False, True):
        L, A = stable_prefix_average_reference(k, v, decay=decay, reverse=reverse)
        L0, A0 = _direct(k, v, decay, reverse)
        assert_close(f"L reverse={reverse}", L, L0)
        assert_close(f"A reverse={reverse}", A, A0)
