"""The aft-simple mixer: forward == the projections around the float64 reference.

What every mixer promises (decoding, padding, causality, autocast, dtypes, constant-size state,
errors) is in test_contract.py.
"""

import pytest
import torch

from aftlab.mixers import build_mixer
from aftlab.mixers.aft.simple import AFTSimple
from aftlab.ops.aft_simple import aft_simple_reference
from aftlab.testing import assert_close


@pytest.mark.parametrize("causal", [False, True])
def test_forward_is_projected_aft_simple(causal):
    m = build_mixer("aft-simple", d_model=6, n_heads=2, causal=causal, max_seq_len=4).double()
    assert isinstance(m, AFTSimple)
    x = torch.randn(2, 11, 6, dtype=torch.float64)  # longer than max_seq_len: any length works
    q, k, v = m.to_q(x), m.to_k(x), m.to_v(x)
    expected = m.proj(aft_simple_reference(q, k, v, causal=causal))
    assert_close("mixer", m(x), expected)
