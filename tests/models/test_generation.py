"""Generation: shapes, determinism, greedy/top-k/top-p, streaming, positional limits, pixel
sampling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aftlab.mixers import available_mixers, get_mixer_class
from aftlab.models import PixelTransformer, TransformerConfig, TransformerLM
from aftlab.models.generation import (
    CausalLM,
    LengthLimit,
    generate,
    sample_next_token,
    sampling_logits,
    stream_generate,
)


def _lm(**kw) -> TransformerLM:
    base = dict(vocab_size=31, d_model=16, n_layers=2, n_heads=2, max_seq_len=24)
    return TransformerLM(TransformerConfig(**{**base, **kw})).eval()


def _prompt(B: int = 3, T: int = 4) -> torch.Tensor:
    return torch.randint(0, 31, (B, T))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_generate_shape_and_prompt_kept():
    lm, prompt = _lm(), _prompt()
    out = lm.generate(prompt, 7)
    assert out.shape == (3, 11) and out.dtype == torch.long
    assert torch.equal(out[:, :4], prompt)
    assert ((out >= 0) & (out < 31)).all()
    assert torch.equal(lm.generate(prompt, 0), prompt)


def test_generate_is_deterministic_with_a_generator():
    lm, prompt = _lm(), _prompt()
    a = lm.generate(prompt, 12, generator=_gen(5))
    b = lm.generate(prompt, 12, generator=_gen(5))
    c = lm.generate(prompt, 12, generator=_gen(6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_greedy_matches_argmax_of_full_forward():
    lm, prompt = _lm(), _prompt()
    out = lm.generate(prompt, 8, temperature=0)
    seq = prompt
    for _ in range(8):  # the slow reference: a full forward pass per new token
        seq = torch.cat([seq, lm(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_top_k_1_and_a_tiny_top_p_are_greedy():
    lm, prompt = _lm(), _prompt()
    greedy = lm.generate(prompt, 8, temperature=0)
    assert torch.equal(lm.generate(prompt, 8, temperature=1.5, top_k=1, generator=_gen(0)), greedy)
    # a nucleus this small holds the most likely token alone
    tiny = lm.generate(prompt, 8, temperature=1.5, top_p=1e-4, generator=_gen(0))
    assert torch.equal(tiny, greedy)


def test_stream_generate_yields_the_same_tokens():
    lm, prompt = _lm(), _prompt()
    stream = lm.stream_generate(prompt, 5, top_k=4, generator=_gen(3))
    toks = list(stream)
    assert len(toks) == 5 and all(t.shape == (3,) for t in toks)
    out = lm.generate(prompt, 5, top_k=4, generator=_gen(3))
    assert torch.equal(torch.stack(toks, 1), out[:, 4:])


def test_stream_generate_checks_arguments_eagerly():
    with pytest.raises(ValueError, match="temperature"):
        _lm().stream_generate(_prompt(), 3, temperature=-1.0)  # no next() needed


def test_generate_does_not_track_gradients():
    lm = _lm()
    assert not lm.generate(_prompt(), 2).requires_grad
    assert torch.is_grad_enabled()


def test_learned_positions_limit_generation():
    lm = _lm(max_seq_len=10)
    assert lm.generate(_prompt(T=4), 6).shape == (3, 10)  # exactly fills the table
    with pytest.raises(ValueError, match=r"4 \+ max_new_tokens 7 = 11 exceeds max_seq_len = 10"):
        lm.generate(_prompt(T=4), 7)
    cache = lm.init_cache(1)
    for _ in range(10):
        lm.step(torch.tensor([1]), cache)
    with pytest.raises(ValueError, match=r"position 10 .* max_seq_len = 10"):
        lm.step(torch.tensor([1]), cache)


@pytest.mark.parametrize(
    "mixer", [n for n in available_mixers() if get_mixer_class(n).length_limited]
)
def test_length_limited_mixers_refuse_long_generation_up_front(mixer):
    lm = _lm(max_seq_len=10, positional="sinusoidal", mixer=mixer)
    assert lm.generate(_prompt(T=4), 6).shape == (3, 10)
    with pytest.raises(ValueError, match=rf"= 11 exceeds max_seq_len = 10, the limit of '{mixer}'"):
        next(lm.stream_generate(_prompt(T=4), 7))  # before any token is yielded


@pytest.mark.parametrize("positional", ["sinusoidal", "rotary", "none"])
def test_unbounded_positions_can_generate_past_max_seq_len(positional):
    lm = _lm(max_seq_len=8, positional=positional)
    assert lm.generate(_prompt(T=4), 9, temperature=0).shape == (3, 13)


def test_a_long_prompt_is_prefilled_in_chunks_equal_to_one_prefill(monkeypatch):
    """A prompt of 21 tokens into an aft-decay model of max_seq_len 8: chunks of 8, 8, 5."""
    from aftlab.models.generation import prefill_prompt

    lm = _lm(max_seq_len=8, positional="none", mixer="aft-decay")
    with torch.no_grad():
        for p in lm.parameters():  # weights 4x the init's: logits that depend on the prompt
            p.mul_(4)
    prompt = _prompt(B=2, T=21)
    with torch.no_grad():
        whole, cache = lm.prefill(prompt, logits_to_keep=1)  # one pass (no length limit)
    seq = prompt
    with torch.no_grad():  # the reference: greedy decoding from the one-pass prefill
        logits = whole[:, -1]
        for _ in range(6):
            token = logits.argmax(-1)
            seq = torch.cat([seq, token[:, None]], 1)
            logits = lm.step(token, cache)
    calls = []
    prefill = TransformerLM.prefill

    def spy(self, idx, **kwargs):
        calls.append((idx.shape[1], kwargs.get("cache") is not None))
        return prefill(self, idx, **kwargs)

    monkeypatch.setattr(TransformerLM, "prefill", spy)
    with torch.no_grad():
        chunked, _ = prefill_prompt(lm, prompt)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    assert calls == [(8, False), (8, True), (5, True)]
    assert torch.equal(lm.generate(prompt, 6, temperature=0), seq)
    assert calls[3:] == [(8, False), (8, True), (5, True)]


def test_a_prompt_longer_than_a_length_limit_keeps_its_error():
    lm = _lm(max_seq_len=8, mixer="aft-decay")  # learned positions
    with pytest.raises(ValueError, match=r"prompt length 9 \+ max_new_tokens 1 = 10 exceeds max_s"):
        lm.generate(_prompt(T=9), 1)


def test_sample_next_token_top_k_support():
    logits = torch.randn(4, 50)
    top3 = logits.topk(3, dim=-1).indices
    g = _gen(0)
    for _ in range(30):
        tok = sample_next_token(logits, temperature=2.0, top_k=3, generator=g)
        assert (tok[:, None] == top3).any(-1).all()
    assert torch.equal(sample_next_token(logits, temperature=0), logits.argmax(-1))


def test_top_p_1_is_no_top_p():
    lm, prompt = _lm(), _prompt()
    kw = dict(temperature=1.3, top_k=9)
    plain = lm.generate(prompt, 10, **kw, generator=_gen(4))
    assert torch.equal(lm.generate(prompt, 10, **kw, top_p=1.0, generator=_gen(4)), plain)
    streamed = lm.stream_generate(prompt, 10, **kw, top_p=1, generator=_gen(4))
    assert torch.equal(torch.stack(list(streamed), 1), plain[:, 4:])
    assert not torch.equal(lm.generate(prompt, 10, **kw, top_p=0.5, generator=_gen(4)), plain)


@pytest.mark.parametrize(
    "top_p, nucleus", [(0.3, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2}), (0.99, {0, 1, 2, 3})]
)
def test_top_p_draws_only_the_nucleus_in_proportion(top_p, nucleus):
    """p = (.5, .3, .15, .05) in a shuffled order: the nucleus of top_p is the fewest most likely
    tokens reaching top_p (.5 < .7 <= .8), drawn in their renormalised proportions."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    order = torch.tensor([2, 0, 3, 1])  # token order[i] has probability probs[i]
    logits = torch.empty(4).index_put_((order,), probs.log()).expand(4000, 4)
    drawn = sample_next_token(logits, top_p=top_p, generator=_gen(7))
    kept = {int(order[i]) for i in nucleus}
    assert set(drawn.unique().tolist()) == kept
    mass = probs[sorted(nucleus)].sum()
    for i in nucleus:  # 4000 draws: a frequency's std is at most 0.008
        freq = (drawn == order[i]).float().mean()
        assert abs(freq - probs[i] / mass) < 0.04, (i, freq)


def test_sampling_logits_equal_transformers_warpers():
    """Temperature, then top-k, then top-p: the same kept tokens and logits as transformers'
    warpers, for every row of random logits (ties included)."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is missing")
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = _gen(11)
    logits = torch.randn(64, 50, generator=g) * 3
    logits[:8, :10] = 1.0  # ties across the boundary
    cases = [(1.0, None, 0.5), (0.7, 20, 0.9), (1.5, 5, 0.3), (0.5, None, 0.95), (2.0, 40, 0.05)]
    for temperature, top_k, top_p in cases:
        ours = sampling_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        theirs = TemperatureLogitsWarper(temperature)(None, logits)
        if top_k is not None:
            theirs = TopKLogitsWarper(top_k)(None, theirs)
        theirs = TopPLogitsWarper(top_p)(None, theirs)
        kept = torch.isfinite(ours)
        assert torch.equal(kept, torch.isfinite(theirs)), (temperature, top_k, top_p)
        assert torch.equal(ours[kept], theirs[kept])
        assert kept.any(-1).all() and not kept.all()
        drawn = sample_next_token(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=g
        )
        assert kept.gather(1, drawn[:, None]).all()


def test_sample_next_token_temperature_sharpens():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(4000, 3)
    g = _gen(1)
    cold = sample_next_token(logits, temperature=0.25, generator=g)
    hot = sample_next_token(logits, temperature=4.0, generator=g)
    assert (cold == 2).float().mean() > 0.9  # p = e^8 / (1 + e^4 + e^8) = 0.98
    assert 0.3 < (hot == 2).float().mean() < 0.5  # p = 0.42


def test_pixel_sampling():
    cfg = TransformerConfig(vocab_size=17, d_model=16, n_layers=2, n_heads=2, max_seq_len=16)
    model = PixelTransformer(cfg, image_shape=(4, 4)).eval()
    a = model.sample(3, generator=_gen(2))
    assert a.shape == (3, 16) and ((a >= 0) & (a < 17)).all()
    assert torch.equal(a, model.sample(3, generator=_gen(2)))
    prefix = torch.randint(0, 17, (3, 5))
    b = model.sample(3, prefix=prefix, generator=_gen(2))
    assert torch.equal(b[:, :5], prefix)
    greedy = model.sample(2, temperature=0)
    assert torch.equal(model.sample(2, top_p=1e-4, generator=_gen(2)), greedy)
    seq = greedy[:, :0]
    for t in range(16):  # reference: full forward per pixel
        nxt = model(torch.cat([seq, torch.zeros(2, 1, dtype=torch.long)], 1))[:, t].argmax(-1)
        seq = torch.cat([seq, nxt[:, None]], 1)
    assert torch.equal(greedy, seq)


class _Successor:
    """A :class:`CausalLM` that is no Transformer (nor a module): the next token is the last
    plus one, mod ``V``; its cache counts the tokens seen."""

    vocab_size = 7
    length_limit = LengthLimit(12, "the successor's table")

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_cache(self, batch_size, *, device=None, dtype=None):
        return {"position": 0}

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return 10.0 * F.one_hot((last + 1) % self.vocab_size, self.vocab_size).float()

    def prefill(self, idx, *, logits_to_keep=0):
        self.calls.append(f"prefill {logits_to_keep}")
        logits = self._logits(idx)[:, -logits_to_keep:] if logits_to_keep else self._logits(idx)
        return logits, {"position": idx.shape[1]}

    def step(self, tokens, cache):
        self.calls.append("step")
        cache["position"] += 1
        return self._logits(tokens)


def test_generate_decodes_any_model_of_the_protocol():
    model = _Successor()
    assert isinstance(model, CausalLM) and isinstance(_lm(), CausalLM)
    prompt = torch.tensor([[3, 4], [6, 0]])
    out = generate(model, prompt, 5, temperature=0)
    assert out.tolist() == [[3, 4, 5, 6, 0, 1, 2], [6, 0, 1, 2, 3, 4, 5]]
    assert model.calls == ["prefill 1"] + ["step"] * 4  # the last position's logits, no re-run
    streamed = [t.tolist() for t in stream_generate(model, prompt, 2, temperature=0)]
    assert streamed == [[5, 1], [6, 2]]
    with pytest.raises(ValueError, match="= 13 exceeds max_seq_len = 12, the limit of \"the succ"):
        generate(model, prompt, 11)
    with pytest.raises(ValueError, match=r"'prompt' ids must be in \[0, vocab_size=7\)"):
        generate(model, prompt + 5, 1)
    with pytest.raises(TypeError, match="'model' must be a causal language model .* got dict"):
        generate({}, prompt, 1)
