"""The RWKV-4 decoding-step kernel (``aftlab::rwkv4_step``, ``csrc/rwkv4.cpp``) against its
reference, the Python step of :class:`aftlab.models.rwkv4.RWKV4Block` (kernels off): logits,
every state tensor and the position, over several steps after a prefill, at odd sizes, with
``B > 1`` and ``rescale_every``; when it runs and when it steps aside; its fake.

The Python step itself is tested against the float64 per-position reference and Hugging Face's
model in tests/models/test_rwkv4.py.
"""

import pytest
import torch

from aftlab import kernels
from aftlab.models import RWKV4LM, RWKV4Config
from aftlab.testing import assert_close

from ..models.rwkv4_helpers import V, assert_float32_close, random_lm, randomise_, scale
from .test_kernels import needs_kernels

pytestmark = needs_kernels


def _decode(lm: RWKV4LM, ids: torch.Tensor, n_prompt: int, *, on: bool):
    """Prefill ``ids[:, :n_prompt]``, then step through the rest: ``(logits (steps, B, V),
    cache)``, with the kernels ``on`` or off."""
    with kernels.use_kernels(on), torch.no_grad():
        _, cache = lm.prefill(ids[:, :n_prompt])
        logits = [lm.step(ids[:, t], cache) for t in range(n_prompt, ids.shape[1])]
    return torch.stack(logits), cache


def _state_tensors(cache) -> dict[str, torch.Tensor]:
    out = {}
    for i, s in enumerate(cache.states):
        sums = s.att.inner
        out |= {f"{i}.last_att": s.att.last, f"{i}.a": sums.a, f"{i}.b": sums.b,
                f"{i}.p": sums.p, f"{i}.last_ffn": s.ffn}  # fmt: skip
    return out


def _counting(monkeypatch) -> list[int]:
    """Count the kernel's calls (the model looks it up at each call)."""
    calls = [0]
    real = kernels.rwkv4.rwkv4_step

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels.rwkv4, "rwkv4_step", counted)
    return calls


def _model(dtype, wide: bool = False):
    """7 layers, rescale_every 3: branches at scales 1, 1/2, 1/4 and two halvings between.
    Widths 32 and 37 (helpers), or ``wide``: 45 and 83, so that the reduced-precision products'
    rows (``step_linear``) end in blocks of 32, of 8 and single elements."""
    if not wide:
        return random_lm(7, seed=3, rescale_every=3).to(dtype)
    cfg = RWKV4Config(vocab_size=V, d_model=45, n_layers=7, d_ff=83, rescale_every=3)
    return randomise_(RWKV4LM(cfg), 3).eval().to(dtype)


def _compare(dtype, check, monkeypatch, B=3, wide=False):
    lm = _model(dtype, wide)
    ids = torch.randint(0, V, (B, 9), generator=torch.Generator().manual_seed(1))
    calls = _counting(monkeypatch)
    ref, ref_cache = _decode(lm, ids, 4, on=False)
    assert calls[0] == 0
    got, cache = _decode(lm, ids, 4, on=True)
    assert calls[0] == 5 * 7  # every block of every step ran the kernel
    check("logits", got, ref)
    assert cache.position == ref_cache.position == 9
    ref_states = _state_tensors(ref_cache)
    for name, t in _state_tensors(cache).items():
        assert t.dtype == ref_states[name].dtype, name
        check(name, t, ref_states[name])
    for s, r in zip(cache.states, ref_cache.states, strict=True):
        assert s.att.inner.position == r.att.inner.position == 9


def test_float64_equals_the_python_step(monkeypatch):
    # float64 throughout: the two differ by summation order only (measured 6e-15 of logits <= 5)
    def check(name, a, b):
        assert_close(name, a, b, rtol=1e-12, atol=1e-12 * max(scale(b), 1.0))

    _compare(torch.float64, check, monkeypatch)


def test_float32_equals_the_python_step(monkeypatch):
    def check(name, a, b):
        if name.endswith(".p"):  # running maxima of keys: no rounding beyond the keys'
            assert_close(name, a, b, rtol=1e-5, atol=1e-5 * max(scale(b), 1.0))
        else:
            assert_float32_close(name, a, b)

    _compare(torch.float32, check, monkeypatch)


@pytest.mark.parametrize("B, wide", [(3, False), (2, True), (17, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_equals_the_python_step(dtype, B, wide, monkeypatch):
    # Both round every elementwise result and every product to the dtype as torch's ops do, from
    # float32. The kernel's products (B <= 16: step_linear; B = 17: ATen's, as the Python step)
    # sum in another order, and its exp and sigmoid (common.h) differ from torch's in the last
    # float32 bits: either can flip one rounding of the dtype (eps 2^-7 bfloat16, 2^-10 float16)
    # and carry it through 7 blocks; 4 eps of the magnitude leave room. The WKV sums are float32.
    eps = torch.finfo(dtype).eps

    def check(name, a, b):
        assert_close(name, a.float(), b.float(), rtol=4 * eps, atol=4 * eps * max(scale(b), 1.0))

    _compare(dtype, check, monkeypatch, B=B, wide=wide)


def test_batch_of_one_and_a_step_from_the_empty_cache(monkeypatch):
    lm = _model(torch.float64)
    calls = _counting(monkeypatch)
    ids = torch.randint(0, V, (1, 3), generator=torch.Generator().manual_seed(2))
    outs = []
    for on in (False, True):
        with kernels.use_kernels(on), torch.no_grad():
            cache = lm.init_cache(1)
            outs.append(torch.stack([lm.step(ids[:, t], cache) for t in range(3)]))
    assert calls[0] == 3 * 7
    assert_close("logits", outs[1], outs[0], rtol=1e-12, atol=1e-12 * scale(outs[0]))
    with torch.no_grad():
        full = lm(ids)[0]
    assert_close("vs forward", outs[1][:, 0], full, rtol=1e-10, atol=1e-10 * scale(full))


def test_steps_aside_when_a_gradient_is_taken(monkeypatch):
    lm = _model(torch.float64)
    calls = _counting(monkeypatch)
    ids = torch.randint(0, V, (2, 3))
    cache = lm.init_cache(2)
    with kernels.use_kernels(True):
        for t in range(2):  # parameters require grad: the Python step
            lm.step(ids[:, t], cache)
        logits = lm.step(ids[:, 2], cache)
    assert calls[0] == 0 and logits.requires_grad
    logits.sum().backward()
    # the decay reaches an output from the third token on, through the state
    assert lm.blocks[0].att.time_decay.grad.abs().sum() > 0
    # frozen parameters but an input that requires grad: still the Python step
    lm.requires_grad_(False)
    block = lm.blocks[0]
    x = torch.randn(2, lm.config.d_model, dtype=torch.float64, requires_grad=True)
    with kernels.use_kernels(True):
        y, _ = block._step(x, block.init_state(2, "cpu", torch.float64))
    assert calls[0] == 0 and y.requires_grad
    with kernels.use_kernels(True), torch.no_grad():
        block._step(x, block.init_state(2, "cpu", torch.float64))
    assert calls[0] == 1


class _Adapted(torch.nn.Linear):
    """A LoRA-like projection: its own forward and a trainable parameter of its own."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__(base.in_features, base.out_features, bias=False, dtype=base.weight.dtype)
        self.weight.data.copy_(base.weight)
        self.up = torch.nn.Parameter(torch.ones(base.out_features, dtype=base.weight.dtype))

    def forward(self, x):
        return super().forward(x) * self.up


def test_steps_aside_for_a_parameter_it_does_not_read(monkeypatch):
    # the kernel reads the block's 18 weights: another trainable parameter (an adapter), or a
    # projection with its own forward, must take the Python step, so its gradient is not lost
    lm = _model(torch.float64).requires_grad_(False)
    calls = _counting(monkeypatch)
    block = lm.blocks[0]
    x, state = torch.randn(2, lm.config.d_model, dtype=torch.float64), block.init_state(2, "cpu",
                                                                                      torch.float64)
    block.extra = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    with kernels.use_kernels(True):
        block._step(x, state)
    assert calls[0] == 0
    del block.extra
    block.ffn.value = _Adapted(block.ffn.value)
    block.ffn.value.weight.requires_grad_(False)
    with kernels.use_kernels(True):
        y, _ = block._step(x, state)
    assert calls[0] == 0 and y.requires_grad
    y.sum().backward()
    assert block.ffn.value.up.grad.abs().sum() > 0
    with kernels.use_kernels(True), torch.no_grad():
        block._step(x, state)  # no gradient, but a forward the kernel does not know: still
    assert calls[0] == 0


def test_steps_aside_under_autocast_and_with_another_state_dtype(monkeypatch):
    lm = _model(torch.float32)
    calls = _counting(monkeypatch)
    block = lm.blocks[0]
    x = torch.randn(2, lm.config.d_model)
    with kernels.use_kernels(True), torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            block._step(x, block.init_state(2, "cpu", torch.float32))
        block._step(x, block.init_state(2, "cpu", torch.float64))
    assert calls[0] == 0


def test_the_fake_gives_the_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    lm = _model(torch.bfloat16)
    block = lm.blocks[0]
    x = torch.randn(2, lm.config.d_model, dtype=torch.bfloat16)
    st = block.init_state(2, "cpu", torch.bfloat16)
    state = [st.att.last, st.att.inner.a, st.att.inner.b, st.att.inner.p, st.ffn]
    with torch.no_grad():
        weights = [t.detach() for t in block._kernel_weights()]
        real = kernels.rwkv4.rwkv4_step(x, state, weights, eps=block.ln1.eps)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = kernels.rwkv4.rwkv4_step(x, state, weights, eps=block.ln1.eps)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    assert [t.dtype for t in real] == [torch.bfloat16] * 2 + [torch.float32] * 3 + [torch.bfloat16]


def test_bad_arguments_are_refused_by_name():
    block = _model(torch.float32).blocks[0]
    x = torch.randn(2, block.ln1.normalized_shape[0])
    st = block.init_state(2, "cpu", torch.float32)
    state = [st.att.last, st.att.inner.a, st.att.inner.b, st.att.inner.p, st.ffn]
    weights = [t.detach() for t in block._kernel_weights()]
    with pytest.raises(RuntimeError, match="rwkv4_step: expects 5 state tensors"):
        kernels.rwkv4.rwkv4_step(x, state[:4], weights, eps=1e-5)
    with pytest.raises(RuntimeError, match="rwkv4_step: state shape"):
        kernels.rwkv4.rwkv4_step(x[:1], state, weights, eps=1e-5)
    with pytest.raises(RuntimeError, match="rwkv4_step: a, b, p must be float32"):
        kernels.rwkv4.rwkv4_step(x, [state[0], *(s.double() for s in state[1:4]), state[4]],
                                 weights, eps=1e-5)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B, K", [(1, 5), (1, 768), (3, 37), (2, 45), (16, 83), (17, 40)])
def test_linear_of_a_few_rows_against_float64(dtype, B, K):
    # rows of W end in blocks of 32, of 8 and single elements; B = 17 (and float32) is ATen's.
    # Each output is the float32 sum rounded once to the dtype: within half an ulp of the exact
    # product (eps |y|) plus the float32 accumulation's K u sum |w x| (u = 2^-24).
    g = torch.Generator().manual_seed(K)
    x = torch.randn(B, K, generator=g).to(dtype)
    W = torch.randn(53, K, generator=g).to(dtype)
    y = kernels.rwkv4.rwkv4_linear(x, W)
    assert y.shape == (B, 53) and y.dtype == dtype
    exact = x.double() @ W.double().T
    magnitude = x.double().abs() @ W.double().abs().T
    bound = torch.finfo(dtype).eps * exact.abs() + K * 2**-24 * magnitude
    assert ((y.double() - exact).abs() <= bound).all()


def test_linear_fake_and_bad_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, W = torch.randn(2, 9, dtype=torch.bfloat16), torch.randn(7, 9, dtype=torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = kernels.rwkv4.rwkv4_linear(x, W)
    assert fake.shape == (2, 7) and fake.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="rwkv4_linear: x must be"):
        kernels.rwkv4.rwkv4_linear(x[0], W)
    with pytest.raises(RuntimeError, match="rwkv4: weight shape"):
        kernels.rwkv4.rwkv4_linear(x, W[:, :8])
