"""RWKV4LM against transformers' RwkvForCausalLM (every parameter random): logits, prefill and
steps, greedy decoding, HF's state both ways, gradients; padding, half precision, rescale_every,
bad input, torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aftlab.mixers.aft.common import ShiftedState
from aftlab.models import RWKV4LM, RWKV4Config
from aftlab.models.rwkv4 import RWKV4State, from_hf_state, to_hf_state
from aftlab.models.rwkv4_io import hf_names
from aftlab.testing import assert_close, assert_same_state

from .rwkv4_helpers import D, V, assert_float32_close, hf_pair, random_lm, randomise_, scale

pytestmark = pytest.mark.usefixtures("one_thread")

B, T = 3, 13


def _ids(b: int = B, t: int = T) -> torch.Tensor:
    return torch.randint(0, V, (b, t))


def _loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, as transformers' ``labels=idx`` computes it."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), idx[:, 1:].reshape(-1))


# --------------------------------------------------------------------------- forward
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("n_layers", [2, 7])  # 7: rescale_every=6 acts in eval mode
def test_logits_equal_transformers(n_layers, train):
    hf, lm = hf_pair(n_layers, train=train)
    assert lm.training is train
    idx = _ids()
    with torch.no_grad():
        want = hf(idx).logits
        assert_float32_close("logits", lm(idx), want)
    # HF rescaled its weights in place at that first eval forward: read back, they are the same
    assert hf.rwkv.layers_are_rescaled is not train
    again = RWKV4LM.from_hf(hf)
    for name, p in lm.state_dict().items():
        assert torch.equal(again.state_dict()[name], p), name


def test_logits_to_keep():
    lm = random_lm(2)
    idx = _ids()
    with torch.no_grad():
        assert torch.equal(lm(idx, logits_to_keep=4), lm(idx)[:, -4:])


# --------------------------------------------------------------------------- decoding
def test_prefill_chunks_and_steps_equal_transformers_forward():
    hf, lm = hf_pair(7)
    idx = _ids()
    with torch.no_grad():
        want = hf(idx).logits
        a, cache = lm.prefill(idx[:, :4])
        b, cache = lm.prefill(idx[:, 4:9], cache=cache)
        steps = [lm.step(idx[:, t], cache) for t in range(9, T)]
    assert cache.position == T
    assert_float32_close("prefill + steps", torch.cat([a, b, torch.stack(steps, 1)], 1), want)


def test_split_prefill_equals_whole_prefill():
    lm = random_lm(7)
    idx = _ids()
    with torch.no_grad():
        whole, want = lm.prefill(idx)
        a, cache = lm.prefill(idx[:, :6])
        b, cache = lm.prefill(idx[:, 6:], cache=cache)
    assert cache.position == want.position == T
    assert_float32_close("logits", torch.cat([a, b], 1), whole)
    # every cache tensor: the token shifts' last inputs and the WKV sums a, b, p
    assert_same_state("cache", cache.states, want.states, torch.float32)


def test_greedy_generate_equals_transformers():
    hf, lm = hf_pair(7)
    prompt = _ids(t=5)
    got = lm.generate(prompt, 12, temperature=0)
    streamed = torch.stack(list(lm.stream_generate(prompt, 12, temperature=0)), 1)
    assert torch.equal(streamed, got[:, 5:])
    # one row at a time: transformers 5.24's one-token step with a state broadcasts a batch of
    # B > 1 to (B, B, V) (RwkvSelfAttention.extract_key_value adds a (B, d) shift to (B, 1, d)),
    # so its batched generate() is wrong after the first new token
    for i in range(B):
        want = hf.generate(prompt[i : i + 1], max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert torch.equal(got[i : i + 1], want), i


# --------------------------------------------------------------------------- HF's state
def test_state_converts_to_and_from_transformers():
    hf, lm = hf_pair(7)
    idx = _ids(t=6)
    with torch.no_grad():
        theirs = hf(idx, use_cache=True).state
        _, cache = lm.prefill(idx)
    ours = to_hf_state(cache)
    assert len(ours) == 5
    for i, (t, h) in enumerate(zip(ours, theirs, strict=True)):
        assert t.dtype == torch.float32 and t.shape == (B, 32, 7), i
        assert_float32_close(f"state[{i}]", t, h)
    back, again = from_hf_state(theirs, position=6), from_hf_state(ours, position=6)
    assert back.position == again.position == 6 and back.batch_size == B
    for i, want in enumerate(cache.states):
        assert_same_state(f"block {i} from HF's state", back.states[i], want, torch.float32)
        assert_same_state(f"block {i} round trip", again.states[i], want, torch.float32)


def test_empty_state_converts_both_ways():
    hf, lm = hf_pair(2)
    empty = to_hf_state(lm.init_cache(B))
    assert torch.all(empty[4] == -1e38) and all(torch.all(t == 0) for t in empty[:4])
    idx = _ids(t=5)
    with torch.no_grad():  # HF from our empty state is HF from none
        assert_float32_close("HF from empty", hf(idx, state=empty).logits, hf(idx).logits)
    # HF's own empty state (pp = -1e30) reads as -inf: aftlab's empty sums
    hf_empty = [torch.zeros(B, 32, 2) for _ in range(5)]
    hf_empty[4] -= 1e30
    sums = from_hf_state(hf_empty).states[0].att.inner
    assert torch.all(sums.p == float("-inf"))
    with torch.no_grad():
        got, _ = lm.prefill(idx, cache=from_hf_state(hf_empty))
        assert_float32_close("ours from HF's empty", got, lm(idx))


def test_transformers_continues_our_state_and_we_continue_its():
    hf, lm = hf_pair(7)
    idx = _ids()
    a, b = idx[:, :6], idx[:, 6:]
    with torch.no_grad():
        want = hf(idx).logits[:, 6:]
        _, cache = lm.prefill(a)
        theirs = hf(b, state=to_hf_state(cache)).logits  # HF after our state
        assert_float32_close("HF continuing ours", theirs, want)
        state = hf(a, use_cache=True).state
        cache = from_hf_state([s.clone() for s in state], position=6)
        got, cache = lm.prefill(b[:, :3], cache=cache)  # ours after HF's state
        steps = [lm.step(b[:, t], cache) for t in range(3, b.shape[1])]
        assert_float32_close("ours continuing HF's", torch.cat([got, torch.stack(steps, 1)], 1),
                             want)  # fmt: skip
        # HF's one-token step from our state, one row (batch 1: see the generate test)
        _, one = lm.prefill(a[:1])
        step = hf(b[:1, :1], state=to_hf_state(one)).logits[:, 0]
        assert_float32_close("HF step after ours", step, want[:1, 0])


# --------------------------------------------------------------------------- gradients
def test_gradients_equal_transformers():
    hf, lm = hf_pair(7, train=True)  # HF in train mode: no rescaling
    idx = _ids()
    hf(idx, labels=idx).loss.backward()
    _loss(lm(idx), idx).backward()
    theirs = dict(hf.named_parameters())
    names = hf_names(7)
    assert set(names) == {n for n, _ in lm.named_parameters()}
    for ours_name, p in lm.named_parameters():
        want = theirs[names[ours_name]].grad.reshape(p.shape)
        assert scale(want) > 0, ours_name  # every path carries gradient
        assert_float32_close(f"d/d{ours_name}", p.grad, want)


class _Chunks(nn.Module):
    """Logits of ``idx`` through ``prefill`` (two chunks, the second continuing the cache) and
    one ``step``: for ``functional_call``."""

    def __init__(self, lm: RWKV4LM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        a, cache = self.lm.prefill(idx[:, :3])
        b, cache = self.lm.prefill(idx[:, 3:-1], cache=cache)
        return torch.cat([a, b, self.lm.step(idx[:, -1], cache)[:, None]], 1)


def test_gradients_through_prefill_chunks_continuing_a_cache():
    lm = random_lm(7).train()
    idx = _ids(t=9)
    _loss(lm(idx), idx).backward()
    want = {n: p.grad for n, p in lm.named_parameters()}
    lm.zero_grad(set_to_none=True)
    _loss(_Chunks(lm)(idx), idx).backward()
    for name, p in lm.named_parameters():
        assert_float32_close(f"d/d{name}", p.grad, want[name])


def test_gradcheck_through_prefill_chunks():
    # float64 finite differences through the chain of caches (the WKV sums a, b, p and the
    # token shifts' last inputs), on the parameters each state carries
    cfg = RWKV4Config(vocab_size=11, d_model=6, n_layers=2, d_ff=7)
    chunks = _Chunks(randomise_(RWKV4LM(cfg)).train()).double()
    names = [
        "lm.blocks.0.att.time_decay", "lm.blocks.0.att.time_bonus", "lm.blocks.0.att.mix_k",
        "lm.blocks.1.ffn.mix_r", "lm.blocks.1.att.to_v.weight",
    ]  # fmt: skip
    params = dict(chunks.named_parameters())
    idx = torch.randint(0, 11, (2, 7))

    def f(*tensors):
        return torch.func.functional_call(chunks, dict(zip(names, tensors, strict=True)), (idx,))

    inputs = tuple(params[n].detach().clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)


# --------------------------------------------------------------------------- padding
def test_left_padded_rows_equal_unpadded_rows():
    lm = random_lm(7).double()  # float64: the padded and unpadded paths round alike
    real = [_ids(1, 9), _ids(1, 6)]
    idx = torch.cat([real[0], torch.cat([_ids(1, 3), real[1]], 1)])  # row 1: 3 pads, any ids
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        got = lm(idx, padding_mask=mask)
        assert_close("unpadded row", got[0], lm(real[0])[0])
        assert_close("left-padded row", got[1, 3:], lm(real[1])[0])


def test_right_padded_rows_equal_unpadded_rows():
    lm = random_lm(7).double()
    real = _ids(1, 5)
    idx = torch.cat([_ids(1, 9), torch.cat([real, _ids(1, 4)], 1)])
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    with torch.no_grad():
        got = lm(idx, padding_mask=mask)
        assert_close("right-padded row", got[1, :5], lm(real)[0])
        assert_close("full row", got[0], lm(idx[:1])[0])
    assert torch.isfinite(got).all()


# --------------------------------------------------------------------------- half precision
#: max |logits - float32 logits| / max |float32 logits| at 7 blocks (B 3, T 13), measured over
#: 8 draws of random weights and ids: up to 2.0e-2 in bfloat16 and 3.9e-3 in float16 (their
#: unit roundoffs: 3.9e-3, 4.9e-4; transformers' RwkvForCausalLM loaded in the same dtypes:
#: 1.5e-2 and 2.0e-3). The bounds are twice that.
HALF_BOUND = {torch.bfloat16: 4e-2, torch.float16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_weights(dtype, tmp_path):
    lm = random_lm(7)  # rescale_every=6 acts: it is what keeps a float16 hidden state in range
    lm.save_pretrained(tmp_path)
    half = RWKV4LM.from_pretrained(tmp_path, dtype=dtype)
    for name, p in half.named_parameters():
        keep = name.endswith(("time_decay", "time_bonus"))  # decays kept in float32
        assert p.dtype == (torch.float32 if keep else dtype), name
    idx = _ids()
    with torch.no_grad():
        want = lm(idx)
        got = half(idx)
        logits, cache = half.prefill(idx[:, :-1])
        last = half.step(idx[:, -1], cache)
    assert got.dtype == logits.dtype == dtype
    for s in cache.states:  # the WKV in float32; the token shifts' inputs in the weights' dtype
        assert {s.att.inner.a.dtype, s.att.inner.b.dtype, s.att.inner.p.dtype} == {torch.float32}
        assert s.att.last.dtype == s.ffn.dtype == dtype
    bound = HALF_BOUND[dtype] * scale(want)
    assert_close("forward", got, want, atol=bound, rtol=0)
    assert_close("prefill + step", torch.cat([logits, last[:, None]], 1), want, atol=bound,
                 rtol=0)  # fmt: skip


# --------------------------------------------------------------------------- rescale_every
def _with_rescaled_eps(lm: RWKV4LM) -> RWKV4LM:
    """``lm`` without rescaling (train mode) and with the LayerNorm epsilons rescaling amounts
    to (RWKV4LM's docstring): block ``l``'s ``eps 4^(l // r)``, ``LN_out``'s ``4^(N // r)``."""
    out = copy.deepcopy(lm).train()
    r, n = lm.config.rescale_every, lm.config.n_layers
    for i, block in enumerate(out.blocks):
        block.ln1.eps = block.ln2.eps = lm.config.layer_norm_eps * 4 ** (i // r)
    out.ln_out.eps = lm.config.layer_norm_eps * 4 ** (n // r)
    return out


#: max |rescaled - not rescaled| / max |logits| in float32, random d=32 models (B 3, T 13, five
#: seeds): up to 9.4e-6 at 7 blocks and 1.3e-5 at 12 (this test's seed: 2.6e-6, 1.3e-5).
#: float64 gives the same figures: they are the epsilons' effect, not rounding.
RESCALE_BOUND = 3e-5


@pytest.mark.parametrize("n_layers", [7, 12])
def test_rescale_every_in_float32(n_layers):
    lm = random_lm(n_layers)  # rescale_every = 6
    idx = _ids()
    with torch.no_grad():
        on, off = lm.eval()(idx), lm.train()(idx)
        lm64 = lm.double()
        on64, off64, eps64 = lm64.eval()(idx), lm64.train()(idx), _with_rescaled_eps(lm64)(idx)
    # the mechanism, exactly (float64): rescaling is LayerNorm with eps * 4^j
    assert_close("rescaled = larger eps", on64, eps64)
    assert (on64 - off64).abs().max() > 1e-7 * scale(off64)  # not a no-op (rounding: ~1e-15)
    assert_close("rescale in float32", on, off, atol=RESCALE_BOUND * scale(off), rtol=0)


# --------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def lm3():
    return RWKV4LM(RWKV4Config(vocab_size=V, d_model=8, n_layers=3)).eval()


def test_bad_ids(lm3):
    with pytest.raises(ValueError, match=r"'idx' ids must be in \[0, vocab_size=99\), got .*99\]"):
        lm3(torch.tensor([[1, 99]]))
    with pytest.raises(ValueError, match=r"'idx' ids must be in .*got values in \[-1, 2\]"):
        lm3.prefill(torch.tensor([[2, -1]]))
    with pytest.raises(TypeError, match="'idx' must be an integer .*float32"):
        lm3(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"'idx' must have shape \(B, T\) .*got \(4,\)"):
        lm3(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"'idx' must hold at least one token, got shape \(2, 0\)"):
        lm3.prefill(torch.zeros(2, 0, dtype=torch.long))
    cache = lm3.init_cache(2)
    with pytest.raises(ValueError, match=r"'tokens' must have shape \(B,\) .*got \(2, 1\)"):
        lm3.step(torch.zeros(2, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"RWKV4LM: 'tokens' ids must be in"):
        lm3.step(torch.tensor([0, 100]), cache)


def test_bad_arguments(lm3):
    idx = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"'padding_mask' must have shape \(2, 4\)"):
        lm3(idx, padding_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="'padding_mask' must be a bool tensor"):
        lm3(idx, padding_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="'logits_to_keep'"):
        lm3(idx, logits_to_keep=-1)
    with pytest.raises(ValueError, match="'batch_size'"):
        lm3.init_cache(0)
    with pytest.raises(TypeError, match="'config' must be an RWKV4Config, got TransformerConfig"):
        from aftlab.models import TransformerConfig

        RWKV4LM(TransformerConfig())


def test_bad_caches_name_the_argument(lm3):
    tokens = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="'tokens' has batch size 2 but 'cache' was made for "
                                         "batch_size=3"):  # fmt: skip
        lm3.step(tokens, lm3.init_cache(3))
    with pytest.raises(ValueError, match="'idx' has batch size 2 but 'cache'"):
        lm3.prefill(tokens[:, None], cache=lm3.init_cache(3))
    other = RWKV4LM(RWKV4Config(vocab_size=V, d_model=8, n_layers=2))
    with pytest.raises(ValueError, match="'cache' holds 2 layer states but the model has "
                                         "n_layers=3"):  # fmt: skip
        lm3.step(tokens, other.init_cache(2))
    with pytest.raises(TypeError, match="'cache' must be a DecodingCache, got list"):
        lm3.step(tokens, to_hf_state(lm3.init_cache(2)))
    cache = lm3.init_cache(2)
    cache.states[1] = cache.states[1].att
    with pytest.raises(TypeError, match=r"'cache.states\[1\]' must be an RWKV4State, got "
                                        "ShiftedState"):  # fmt: skip
        lm3.step(tokens, cache)
    cache = lm3.init_cache(2)
    cache.states[2] = RWKV4State(cache.states[2].att.inner, cache.states[2].ffn)
    with pytest.raises(TypeError, match=r"cache.states\[2\].att"):
        lm3.step(tokens, cache)
    cache = lm3.init_cache(2)
    cache.states[0].ffn = torch.zeros(2, 9)
    with pytest.raises(ValueError, match=r"'cache.states\[0\].ffn' must have shape \(2, 8\), "
                                         r"got \(2, 9\)"):  # fmt: skip
        lm3.step(tokens, cache)
    assert isinstance(lm3.init_cache(2).states[0].att, ShiftedState)


def test_from_hf_state_refuses_other_lists():
    with pytest.raises(ValueError, match="list of 5 tensors"):
        from_hf_state([torch.zeros(1, 4, 2)] * 4)
    bad = [torch.zeros(1, 4, 2)] * 4 + [torch.zeros(1, 4, 3)]
    with pytest.raises(ValueError, match=r"'state\[4\]' must have shape \(1, 4, 2\)"):
        from_hf_state(bad)


# --------------------------------------------------------------------------- torch.compile
def test_compiled_forward_equals_eager():
    # one graph (fullgraph) with the ops as dispatched: the C++ kernel's fake where it is built,
    # the PyTorch op under AFTLAB_KERNELS=0 (the aft-decay op itself is compiled on both in
    # tests/models/test_compile.py)
    torch._dynamo.reset()
    lm = random_lm(2, rescale_every=1)  # eval: the rescaling in the graph
    idx = _ids()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :4] = False
    with torch.no_grad():
        want = lm(idx, padding_mask=mask)
        got = torch.compile(lm, fullgraph=True, backend="aot_eager")(idx, padding_mask=mask)
    assert_float32_close("compiled logits", got, want)


def test_the_channel_mix_without_autograd_equals_it_with_and_spares_what_hooks_hold():
    # without autograd the channel mix computes relu^2 and its gate in place: the same bits,
    # but not over a tensor a forward hook may keep (activation caching and patching)
    ffn = random_lm(2, seed=1).blocks[0].ffn
    x = torch.randn(2, 5, D)
    with_grad = ffn(x)
    with torch.no_grad():
        assert torch.equal(ffn(x), with_grad)
    held, before = [], []

    def keep(module, args, out):
        held.append(out)
        before.append(out.clone())

    for register in (ffn.key.register_forward_hook, nn.modules.module.register_module_forward_hook):
        handle = register(keep)
        with torch.no_grad():
            assert torch.equal(ffn(x), with_grad)
        handle.remove()
        assert held and all(torch.equal(h, b) for h, b in zip(held, before, strict=True))
        held.clear(), before.clear()
