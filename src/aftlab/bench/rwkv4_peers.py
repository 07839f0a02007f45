"""RWKV-4 beside its peers in one run: transformers' ``RwkvForCausalLM``, ChatRWKV (PyPI
``rwkv``, strategy ``"cpu fp32"``) and aftlab's ``RWKV4LM`` (issue 23's targets).

Every peer runs the same random weights (every parameter randomised: :func:`randomise_`), in
float32 on ``--threads`` threads, batch 1 for inference, under ``torch.inference_mode``. The
parts (``--parts``), each timed round-robin over the peers after a warm-up call:

* ``train``: one forward+backward step (cross-entropy over every position) at d 256, 4 layers,
  B 4, T 1024, vocabulary ``--train-vocab`` (256: at 50277 the head's matrix products, the same
  work in every implementation, would be most of the step); transformers and aftlab (ChatRWKV
  does not train). Median of ``--repeats``.
* ``prefill``: a 1,024-token prompt at each of ``--shapes``, the last position's logits only
  (transformers ``logits_to_keep=1``; also a row of its default, the logits of every
  position). Median of ``--repeats``; the last logits of each peer against transformers'.
* ``decode``: ms per token after a 16-token prompt: the median of ``--decode-steps`` steps
  after 4 untimed ones, the peers' steps interleaved.
* ``long``: 16,384 tokens in chunks of 1,024, each continuing the state, in a fresh process
  per peer (peak RSS is a process's): the wall time, the RSS once the weights are loaded and
  the peak RSS during the prefill (``/proc/self/clear_refs`` resets it after loading).
* ``bf16``: decode with bfloat16 weights (ChatRWKV ``"cpu bf16"``; transformers' weights in
  bfloat16 but ``time_decay`` and ``time_first``, as ``from_pretrained`` keeps them).

Floors, from the same run. Prefill: the model's matrix-product FLOPs over the GEMM rate, the
rate of one block's own products (``F.linear`` at the prompt's shapes, the fastest of 5 calls):
``FLOPs = 2 T L (5 d^2 + 2 d I) + 2 V d`` (time-mix key, value, receptance, output and
channel-mix receptance ``d x d``, channel-mix key and value ``d x I``; the head for the last
position only, which is all a prefill needs). Training: ``6 B T (L (5 d^2 + 2 d I) + V d)``
(the backward twice the forward). Decode: the weight bytes read per token over the memory
bandwidth (the fastest of ``measure_limits``' copy and add and a read-only sum): every matrix
and the head once, the ``11 d`` vectors of each block, one embedding row.

    python benchmarks/rwkv4_peers.py [--shapes 169m,430m]
        [--parts train,prefill,decode,long,bf16] [--threads 2] [--repeats 3]
        [--decode-steps 32] [--train-vocab 256] [--json OUT] [--quick]

``aftlab bench --suite rwkv4-peers`` takes those of the shapes, parts, threads and repeats
(docs/benchmarks.md). ``--quick`` (``--shapes
tiny``): tiny shapes and lengths, a smoke test (its numbers mean nothing). The peers are
extras: ``pip install transformers rwkv``.
aftlab's model comes from :func:`aftlab_model`; without ``aftlab.models.rwkv4`` the script
prints "aftlab RWKV4LM not available" and measures the peers alone.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from aftlab._system import machine_info, memory_baseline, peak_rss_bytes, proc_bytes

PEERS = ("transformers", "ChatRWKV", "aftlab")
PARTS = ("train", "prefill", "decode", "long", "bf16")
MIB = 2**20


class Shape(NamedTuple):
    """An RWKV-4 model's sizes: vocabulary ``V``, width ``d``, ``L`` blocks, channel-mix ``I``."""

    name: str
    vocab: int
    d: int
    layers: int
    ffn: int


SHAPES = {
    "169m": Shape("169m", 50277, 768, 12, 3072),  # RWKV/rwkv-4-169m-pile
    "430m": Shape("430m", 50277, 1024, 24, 4096),
    "1b5": Shape("1b5", 50277, 2048, 24, 8192),  # rwkv.cpp's published figures
    "tiny": Shape("tiny", 503, 48, 7, 131),  # --quick: odd sizes, past rescale_every = 6
}


class Plan(NamedTuple):
    """The lengths of a run: ``FULL`` (issue 23) or ``QUICK`` (a smoke test)."""

    prefill: int
    long: int
    chunk: int
    prompt: int
    warmup_steps: int
    train_batch: int
    train_tokens: int
    train_shape: Shape


FULL = Plan(1024, 16384, 1024, 16, 4, 4, 1024, Shape("train", 256, 256, 4, 1024))
QUICK = Plan(64, 256, 64, 8, 2, 2, 32, Shape("train-tiny", 61, 32, 2, 64))


# --------------------------------------------------------------------------- counting
def matrix_params(s: Shape) -> int:
    """Weights of the blocks' matrix products: ``L (5 d^2 + 2 d I)``."""
    return s.layers * (5 * s.d * s.d + 2 * s.d * s.ffn)


def prefill_flops(s: Shape, tokens: int, logits: int = 1) -> float:
    """``2 T L (5 d^2 + 2 d I) + 2 n V d``: a prefill of ``T`` tokens, the head at ``n``
    positions."""
    return 2.0 * tokens * matrix_params(s) + 2.0 * logits * s.vocab * s.d


def train_flops(s: Shape, batch: int, tokens: int) -> float:
    """``6 B T (L (5 d^2 + 2 d I) + V d)``: forward (2) and backward (4) per weight and token."""
    return 6.0 * batch * tokens * (matrix_params(s) + s.vocab * s.d)


def param_count(s: Shape) -> int:
    """All parameters: the matrices, embedding and head ``2 V d``, each block's ``11 d``
    vectors (2 layer norms, ``time_decay``, ``time_first``, 5 mixes), ``pre_ln`` and ``ln_out``."""
    return matrix_params(s) + 2 * s.vocab * s.d + 11 * s.layers * s.d + 4 * s.d


def weight_bytes_per_token(s: Shape, itemsize: int) -> int:
    """Bytes a decoding step reads, at ``itemsize`` bytes a weight: every parameter once but
    the embedding, of which one row (the state, ``5 L d`` floats, is left out)."""
    return itemsize * (param_count(s) - s.vocab * s.d + s.d)


# --------------------------------------------------------------------------- weights
def hf_config(s: Shape, *, context: int = 1024):
    """transformers' ``RwkvConfig`` of shape ``s`` (``rescale_every`` its default, 6)."""
    from transformers import RwkvConfig

    return RwkvConfig(
        vocab_size=s.vocab, hidden_size=s.d, num_hidden_layers=s.layers,
        intermediate_size=s.ffn, context_length=context,
    )


def hf_model(s: Shape, *, seed: int = 0, context: int = 1024):
    """A transformers ``RwkvForCausalLM`` of shape ``s`` with :func:`randomise_`'d weights."""
    from transformers import RwkvForCausalLM

    with torch.device("meta"):  # skip transformers' init (orthogonal: a QR per matrix)
        model = RwkvForCausalLM(hf_config(s, context=context))
    model.to_empty(device="cpu")
    return randomise_(model, seed=seed)


def hf_from_state(config, state: dict[str, torch.Tensor]):
    """A transformers model holding the tensors of ``state`` (no copy), never run."""
    from transformers import RwkvForCausalLM

    with torch.device("meta"):
        model = RwkvForCausalLM(config)
    model.load_state_dict(state, assign=True)
    return model


@torch.no_grad()
def randomise_(model: torch.nn.Module, *, seed: int) -> torch.nn.Module:
    """Every parameter random, in place: matrices ``N(0, 1/fan_in)``, embeddings ``N(0, 1)``,
    layer norms ``1 + N(0, 0.04)`` and ``N(0, 0.04)``, ``time_decay ~ U(-4, 2)`` (raw: the
    decay is ``-exp``), ``time_first ~ N(0, 1)``, the mixes ``U(0, 1)``."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        x = torch.empty(p.shape)
        if name.endswith("time_decay"):
            x.uniform_(-4, 2, generator=g)
        elif name.endswith("time_first") or "embeddings" in name:
            x.normal_(generator=g)
        elif "time_mix" in name:
            x.uniform_(0, 1, generator=g)
        elif name.endswith("bias"):
            x.normal_(0, 0.2, generator=g)
        elif x.ndim == 1:  # layer norm weights
            x.normal_(1, 0.2, generator=g)
        else:
            x.normal_(0, x.shape[1] ** -0.5, generator=g)
        p.copy_(x)
    return model


def hf_weights(model) -> dict[str, torch.Tensor]:
    """``model``'s state dict as trained (copies): transformers divides ``attention.output``
    and ``feed_forward.value`` of block ``i`` by ``2 ** (i // rescale_every)`` in place at
    the first forward in eval mode (``RwkvModel._rescale_layers``); multiplied back here
    (exactly: powers of two)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    every = model.config.rescale_every
    if model.rwkv.layers_are_rescaled and every > 0:
        for i in range(model.config.num_hidden_layers):
            for part in ("attention.output", "feed_forward.value"):
                sd[f"rwkv.blocks.{i}.{part}.weight"] *= 2 ** (i // every)
    return sd


_TO_BLINKDL = [  # transformers' names -> BlinkDL's .pth names (RWKV-LM, ChatRWKV)
    (r"^rwkv\.", ""),
    (r"^embeddings\.", "emb."),
    (r"\.pre_ln\.", ".ln0."),
    (r"\.attention\.", ".att."),
    (r"\.feed_forward\.", ".ffn."),
    (r"\.time_mix_key$", ".time_mix_k"),
    (r"\.time_mix_value$", ".time_mix_v"),
    (r"\.time_mix_receptance$", ".time_mix_r"),
]


def blinkdl_state_dict(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' RWKV-4 state dict (:func:`hf_weights`) under BlinkDL's names, tensors
    unchanged: the shapes agree (``time_mix_*`` ``(1, 1, d)``, which ChatRWKV squeezes;
    ``time_decay`` and ``time_first`` ``(d,)``, ``time_decay`` raw in both, ``w = -exp``)."""
    out = {}
    for name, tensor in hf_state.items():
        for pattern, new in _TO_BLINKDL:
            name = re.sub(pattern, new, name)
        out[name] = tensor
    return out


def bf16_hf(model):
    """A bfloat16 copy of a transformers model, ``time_decay`` and ``time_first`` float32."""
    m = copy.deepcopy(model).to(torch.bfloat16)
    for name, p in m.named_parameters():
        if name.endswith(("time_decay", "time_first")):
            p.data = p.data.float()
    return m


# --------------------------------------------------------------------------- peers
def aftlab_model(hf, dtype: torch.dtype | None = None):
    """aftlab's RWKV-4 with ``hf``'s weights (None when ``aftlab.models.rwkv4`` is absent).

    The one place that knows aftlab's RWKV-4 API: ``RWKV4LM.from_hf``, then ``prefill(idx,
    cache=, logits_to_keep=)`` and ``step(tokens (B,), cache)`` as ``TransformerLM``'s.
    """
    try:
        from aftlab.models.rwkv4 import RWKV4LM
    except ImportError:
        return None
    return RWKV4LM.from_hf(hf, dtype=dtype)  # decays and bonuses stay float32


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


class HFPeer:
    """transformers' ``RwkvForCausalLM`` (its CPU path: a Python loop over positions)."""

    def __init__(self, model) -> None:
        self.model = model

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, state=None, *, last_only: bool = True):
        """``ids (T,)`` -> (logits ``(V,)``, or ``(T, V)`` without ``last_only``; state)."""
        out = self.model(ids[None], state=state, use_cache=True, logits_to_keep=int(last_only))
        return out.logits[0, -1] if last_only else out.logits[0], out.state

    @torch.inference_mode()
    def step(self, token: int, state):
        out = self.model(torch.tensor([[token]]), state=state, use_cache=True)
        return out.logits[0, -1], out.state

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        return _lm_loss(_logits(self.model(ids)), ids)


class ChatRWKVPeer:
    """ChatRWKV (PyPI ``rwkv``): ``RWKV(model=path, strategy=...)``, ``RWKV_JIT_ON=1``,
    ``RWKV_CUDA_ON=0``; its prefill computes the last logits only."""

    def __init__(self, pth: Path, strategy: str = "cpu fp32") -> None:
        self.model = chatrwkv_class()(model=str(pth.with_suffix("")), strategy=strategy,
                                      verbose=False)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, state=None, *, last_only: bool = True):
        return self.model.forward(ids.tolist(), state, full_output=not last_only)

    @torch.inference_mode()
    def step(self, token: int, state):
        return self.model.forward([token], state)


class AftlabPeer:
    """aftlab's ``RWKV4LM`` (:func:`aftlab_model`)."""

    def __init__(self, model) -> None:
        self.model = model

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, state=None, *, last_only: bool = True):
        logits, cache = self.model.prefill(ids[None], cache=state, logits_to_keep=int(last_only))
        return logits[0, -1] if last_only else logits[0], cache

    @torch.inference_mode()
    def step(self, token: int, state):
        return self.model.step(torch.tensor([token]), state)[0], state

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        return _lm_loss(_logits(self.model(ids)), ids)


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def chatrwkv_class():
    """ChatRWKV's ``RWKV`` class, imported with its switches set (they are read at import);
    the backend flags its import sets (cuDNN benchmark, TF32) put back."""
    os.environ.update(RWKV_JIT_ON="1", RWKV_CUDA_ON="0", RWKV_V7_ON="0")
    b = torch.backends
    flags = b.cudnn.benchmark, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32
    from rwkv.model import RWKV

    b.cudnn.benchmark, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = flags
    return RWKV


def aftlab_available() -> bool:
    try:
        import aftlab.models.rwkv4  # noqa: F401
    except ImportError:
        return False
    return True


def chatrwkv_available() -> bool:
    try:
        chatrwkv_class()
    except ImportError:
        return False
    return True


def save_blinkdl(hf, folder: Path) -> Path:
    """``folder/blinkdl.pth``: ``hf``'s weights for ChatRWKV (a plain dict of tensors)."""
    path = folder / "blinkdl.pth"
    torch.save(blinkdl_state_dict(hf_weights(hf)), path)
    return path


def build_peers(hf, folder: Path, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The peers available, by name, on ``hf``'s weights (aftlab's from a model that has not
    run in eval mode, whose weights are as trained)."""
    if hf.rwkv.layers_are_rescaled:
        hf = hf_from_state(hf.config, hf_weights(hf))
    ours = aftlab_model(hf, None if dtype == torch.float32 else dtype)
    base = hf if dtype == torch.float32 else bf16_hf(hf)
    peers: dict[str, Any] = {"transformers": HFPeer(base.eval())}
    if chatrwkv_available():
        strategy = "cpu fp32" if dtype == torch.float32 else "cpu bf16"
        peers["ChatRWKV"] = ChatRWKVPeer(save_blinkdl(hf, folder), strategy)
    if ours is not None:
        peers["aftlab"] = AftlabPeer(ours.eval())
    return peers


# --------------------------------------------------------------------------- measuring
def token_ids(s: Shape, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` seeded random token ids ``(n,)`` of ``s``'s vocabulary."""
    return torch.randint(0, s.vocab, (n,), generator=torch.Generator().manual_seed(seed))


def round_robin(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of ``repeats`` calls of each ``fn`` after one untimed call, taken in turns so
    that a slow phase of the machine hits every peer."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def gemm_rate(mats: list[tuple[int, int, int]], repeats: int = 5) -> float:
    """FLOP/s of ``F.linear`` over ``(rows, in, out)`` products, float32: their ``2 rows in
    out`` FLOPs over the fastest of ``repeats`` calls after a warm-up."""
    xs = [(torch.randn(r, i), torch.randn(o, i)) for r, i, o in mats]
    flops = sum(2.0 * r * i * o for r, i, o in mats)

    def run():
        for x, w in xs:
            F.linear(x, w)

    return flops / min(round_robin({"gemm": run}, repeats)["gemm"])


def block_gemms(s: Shape, rows: int) -> list[tuple[int, int, int]]:
    """One block's matrix products at ``rows`` tokens: 5 ``d x d``, ``d -> I``, ``I -> d``."""
    return [(rows, s.d, s.d)] * 5 + [(rows, s.d, s.ffn), (rows, s.ffn, s.d)]


def bandwidth(quick: bool) -> dict[str, float]:
    """Memory bandwidth, bytes/s: ``measure_limits``' copy and add, and a read-only sum of
    the same ``N`` floats; ``bandwidth_bytes_per_s`` the largest (a floor is a lower bound)."""
    from aftlab.bench.measure import measure_limits  # not in the long prefill's processes

    lim = measure_limits(torch.device("cpu"), torch.float32, size="tiny" if quick else "full")
    x = torch.randn(lim["stream_elements"])
    total = round_robin({"sum": x.sum}, 5)["sum"]
    lim["sum_bytes_per_s"] = x.numel() * x.element_size() / min(total)
    lim["bandwidth_bytes_per_s"] = max(lim["bandwidth_bytes_per_s"], lim["sum_bytes_per_s"])
    return lim


def max_rel_diff(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(max |a - ref|, that over max |ref|)``, in float64."""
    d = (a.double() - ref.double()).abs().max().item()
    return d, d / max(ref.double().abs().max().item(), 1e-30)


def row(part: str, shape: str, what: str, unit: str, values: dict[str, float], *,
        floor: float | None = None, target: str = "", met: bool | None = None, **extra) -> dict:
    return {"part": part, "shape": shape, "what": what, "unit": unit, "peers": values,
            "floor": floor, "target": target, "met": met, **extra}


def train_rows(plan: Plan, repeats: int, rate: float) -> list[dict]:
    """One forward+backward step of transformers and aftlab (training mode) on one batch."""
    s, B, T = plan.train_shape, plan.train_batch, plan.train_tokens
    hf = hf_model(s, context=T).train()
    peers: dict[str, Any] = {"transformers": HFPeer(hf)}
    if (ours := aftlab_model(hf)) is not None:
        peers["aftlab"] = AftlabPeer(ours.train())
    ids = torch.randint(0, s.vocab, (B, T), generator=torch.Generator().manual_seed(1))

    def stepper(peer):
        def step():
            peer.model.zero_grad(set_to_none=True)
            peer.loss(ids).backward()

        return step

    times = round_robin({n: stepper(p) for n, p in peers.items()}, repeats)
    med = {n: median(t) for n, t in times.items()}
    floor = train_flops(s, B, T) / rate
    met = med["transformers"] / med["aftlab"] >= 10 if "aftlab" in med else None
    what = f"train step, B {B} T {T} (d {s.d}, {s.layers} layers, V {s.vocab})"
    return [row("train", s.name, what, "s", med, floor=floor,
                target=">= 10x faster than transformers", met=met)]


def prefill_rows(s: Shape, peers: dict[str, Any], plan: Plan, repeats: int, rate: float):
    """Prefill of ``plan.prefill`` tokens (last logits), and transformers' all-logits one;
    each peer's last logits against transformers'."""
    ids = token_ids(s, plan.prefill)
    last: dict[str, torch.Tensor] = {}

    def call(name, peer):
        def run():
            last[name] = peer.prefill(ids)[0]

        return run

    times = round_robin({n: call(n, p) for n, p in peers.items()}, repeats)
    med = {n: median(t) for n, t in times.items()}
    floor = prefill_flops(s, plan.prefill) / rate
    met = None
    if "aftlab" in med:
        others = [med[n] for n in med if n != "aftlab"]
        met = med["aftlab"] <= min(others) and med["aftlab"] <= 1.25 * floor
    agree = {n: max_rel_diff(v, last["transformers"]) for n, v in last.items()
             if n != "transformers"}
    full = round_robin({"transformers": lambda: peers["transformers"].prefill(
        ids, last_only=False)}, repeats)
    return [
        row("prefill", s.name, f"prefill {plan.prefill} tokens, last logits", "s", med,
            floor=floor, target="<= every peer and <= 1.25x floor", met=met,
            max_diff_vs_transformers=agree),
        row("prefill", s.name, f"prefill {plan.prefill} tokens, all logits", "s",
            {"transformers": median(full["transformers"])},
            floor=prefill_flops(s, plan.prefill, plan.prefill) / rate),
    ]


def decode_times(peers: dict[str, Any], s: Shape, plan: Plan, steps: int) -> dict[str, float]:
    """Median seconds per decoding step after a ``plan.prompt`` prefill and
    ``plan.warmup_steps`` untimed steps; the peers' steps interleaved."""
    tokens = token_ids(s, plan.prompt + plan.warmup_steps + steps, seed=2).tolist()
    states = {n: p.prefill(torch.tensor(tokens[: plan.prompt]))[1] for n, p in peers.items()}
    times: dict[str, list[float]] = {n: [] for n in peers}
    for i, tok in enumerate(tokens[plan.prompt :]):
        for n, p in peers.items():
            t0 = time.perf_counter()
            _, states[n] = p.step(tok, states[n])
            if i >= plan.warmup_steps:
                times[n].append(time.perf_counter() - t0)
    return {n: median(t) for n, t in times.items()}


def decode_row(s: Shape, peers: dict[str, Any], plan: Plan, steps: int, bw: float,
               *, dtype: torch.dtype = torch.float32, fp32: dict | None = None) -> dict:
    med = {n: 1e3 * t for n, t in decode_times(peers, s, plan, steps).items()}
    itemsize = torch.empty((), dtype=dtype).element_size()
    floor = 1e3 * weight_bytes_per_token(s, itemsize) / bw
    name = str(dtype).replace("torch.", "")
    if dtype == torch.float32:
        ours, met = med.get("aftlab"), None
        if ours is not None:
            met = ours <= med.get("ChatRWKV", float("inf")) and ours <= 1.5 * floor
        return row("decode", s.name, "decode, ms/token", "ms", med, floor=floor,
                   target="<= ChatRWKV and <= 1.5x floor", met=met)
    speedup = {n: fp32["peers"][n] / v for n, v in med.items() if n in fp32["peers"]}
    return row("bf16", s.name, f"decode, {name} weights, ms/token", "ms", med, floor=floor,
               target="close to 2x faster than float32", speedup_vs_float32=speedup)


# --------------------------------------------------------------------------- long prompts
def long_child(peer: str, shape: str, tokens: int, chunk: int, threads: int, folder: str):
    """In a fresh process: load ``peer`` from ``folder`` (a Hugging Face folder: ``config.json``
    and ``model.safetensors``; ChatRWKV ``blinkdl.pth``; aftlab ``RWKV4LM.from_pretrained``, as
    a user loads it),
    prefill ``tokens`` ids in chunks of ``chunk``; print JSON (RSS after loading, peaks,
    seconds) and save the last logits to ``folder/<peer>.logits.pt``."""
    torch.set_num_threads(threads)
    s, root = SHAPES[shape], Path(folder)
    if peer == "ChatRWKV":
        model: Any = ChatRWKVPeer(root / "blinkdl.pth")
    elif peer == "aftlab":
        from aftlab.models.rwkv4 import RWKV4LM

        model = AftlabPeer(RWKV4LM.from_pretrained(root).eval())
    else:
        from transformers import RwkvConfig

        config = RwkvConfig.from_json_file(root / "config.json")
        model = HFPeer(hf_from_state(config, load_file(root / "model.safetensors")).eval())
    gc.collect()
    load_peak = peak_rss_bytes()
    loaded = memory_baseline(torch.device("cpu"), reset=True)  # clears the peak (None: cannot)
    loaded_rss = proc_bytes("self/status", "VmRSS") if loaded is None else loaded
    ids, state, t0 = token_ids(s, tokens, seed=3), None, time.perf_counter()
    for start in range(0, tokens, chunk):
        logits, state = model.prefill(ids[start : start + chunk], state)
    seconds = time.perf_counter() - t0
    torch.save(logits.float().clone(), root / f"{peer}.logits.pt")
    print(json.dumps({
        "seconds": seconds, "loaded_mib": loaded_rss / MIB, "load_peak_mib": load_peak / MIB,
        "prefill_peak_mib": peak_rss_bytes() / MIB, "peak_reset": loaded is not None,
    }))


def long_rows(s: Shape, names: list[str], hf, plan: Plan, threads: int, rate: float,
              folder: Path) -> list[dict]:
    """Chunked prefill of ``plan.long`` tokens, one fresh process per peer."""
    hf.config.to_json_file(folder / "config.json")
    save_file(hf_weights(hf), folder / "model.safetensors", metadata={"format": "pt"})
    if "ChatRWKV" in names and not (folder / "blinkdl.pth").exists():
        save_blinkdl(hf, folder)
    out, logits = {}, {}
    for name in names:
        done = subprocess.run(
            [sys.executable, __file__, "_long", name, s.name,  # not -m: no aftlab.bench import
             str(plan.long), str(plan.chunk), str(threads), str(folder)],
            check=True, capture_output=True, text=True,
        )
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
        logits[name] = torch.load(folder / f"{name}.logits.pt", weights_only=True)
    agree = {n: max_rel_diff(v, logits["transformers"]) for n, v in logits.items()
             if n != "transformers"}
    what = f"prefill {plan.long} tokens in chunks of {plan.chunk}"
    floor = prefill_flops(s, plan.long) / rate
    weights = 4 * param_count(s)
    return [
        row("long", s.name, what, "s", {n: o["seconds"] for n, o in out.items()}, floor=floor,
            max_diff_vs_transformers=agree),
        row("long", s.name, "  RSS with the weights loaded (floor: the weights)", "MiB",
            {n: o["loaded_mib"] for n, o in out.items()}, floor=weights / MIB),
        row("long", s.name, "  peak RSS during the prefill", "MiB",
            {n: o["prefill_peak_mib"] for n, o in out.items()},
            target="one chunk's activations plus the weights",
            peak_reset={n: o["peak_reset"] for n, o in out.items()}),
        row("long", s.name, "  peak RSS while loading", "MiB",
            {n: o["load_peak_mib"] for n, o in out.items()}),
    ]


# --------------------------------------------------------------------------- report
def fmt(x: float | None) -> str:
    if x is None:
        return "--"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def table(rows: list[dict]) -> str:
    """The rows as one markdown table: a column per peer, the floor, aftlab over the floor."""
    names = [n for n in PEERS if any(n in r["peers"] for r in rows)]
    head = ["measurement", "shape", "unit", *names, "floor", "aftlab / floor", "target", "met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ours = r["peers"].get("aftlab")
        ratio = ours / r["floor"] if ours is not None and r["floor"] else None
        met = {None: "", True: "yes", False: "no"}[r["met"]]
        cells = [r["what"], r["shape"], r["unit"], *(fmt(r["peers"].get(n)) for n in names),
                 fmt(r["floor"]), fmt(ratio), r["target"], met]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rwkv_cpp_note(bw: float, threads: int, cpu: str) -> str:
    """rwkv.cpp's published RWKV-4 1.5B latencies against this machine's bandwidth floor."""
    s = SHAPES["1b5"]
    ours = weight_bytes_per_token(s, 4)
    return (
        "rwkv.cpp (published, README 'Quality and performance', not run here): RWKV-4 1.5B "
        "198 ms/token FP32, 117 ms FP16, 89 ms Q8_0, on a 4-core/8-thread x86 CPU with AVX2, "
        f"4 threads. FP32 reads about {ours / 1e9:.2f} GB a token: {ours / 0.198 / 1e9:.1f} GB/s "
        f"there. This machine: {cpu}, {threads} threads, {bw / 1e9:.1f} GB/s measured: its "
        f"1.5B FP32 floor is {1e3 * ours / bw:.0f} ms/token (bfloat16 "
        f"{1e3 * weight_bytes_per_token(s, 2) / bw:.0f} ms)."
    )


def load_average() -> tuple[float, float, float]:
    """``uptime``'s load average (1, 5, 15 minutes)."""
    return os.getloadavg()


def main(argv: list[str] | None = None) -> dict:
    """``python -m aftlab.bench.rwkv4_peers`` (and ``benchmarks/rwkv4_peers.py``): the options
    of the module docstring; a bad one exits 2 naming it."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_long":
        long_child(argv[1], argv[2], *(int(x) for x in argv[3:6]), argv[6])
        return {}
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="169m,430m", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--train-vocab", type=int, default=256)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    a = p.parse_args(argv)
    shapes = ["tiny"] if a.quick else a.shapes.split(",")
    try:
        check_options(shapes, a.parts.split(","), threads=a.threads, repeats=a.repeats,
                      decode_steps=a.decode_steps, train_vocab=a.train_vocab)
    except ValueError as e:
        p.error(str(e))
    return run(shapes, a.parts.split(","), threads=a.threads, repeats=a.repeats,
               decode_steps=a.decode_steps, train_vocab=a.train_vocab, json_path=a.json)


def check_options(shapes: list[str], parts: list[str], **counts: int) -> None:
    """Raise ``ValueError`` naming the option (``--shapes``, ``--parts``, ``--threads``, ...)
    unless ``shapes`` and ``parts`` are names of :data:`SHAPES` and :data:`PARTS` (``tiny``,
    the smoke test, alone) and every count is a positive int."""
    for option, got, allowed in (("--shapes", shapes, SHAPES), ("--parts", parts, PARTS)):
        if bad := [x for x in got if x not in allowed] or ([] if got else ["nothing"]):
            raise ValueError(f"{option}: expected names of {', '.join(allowed)}, "
                             f"got {', '.join(bad)}")
    if "tiny" in shapes and len(shapes) > 1:
        raise ValueError(f"--shapes: expected 'tiny' (the smoke test) alone, got {shapes}")
    for option, got in counts.items():
        if not isinstance(got, int) or isinstance(got, bool) or got < 1:
            raise ValueError(f"--{option.replace('_', '-')}: expected a positive int, got {got}")


def _print(line: str) -> None:
    print(line, flush=True)


def run(shapes: list[str], parts: list[str], *, threads: int = 2, repeats: int = 3,
        decode_steps: int = 32, train_vocab: int = 256,
        json_path: str | os.PathLike | None = None,
        log: Callable[[str], None] | None = _print) -> dict:
    """Measure ``parts`` at ``shapes`` (``["tiny"]``: the smoke test's :data:`QUICK` lengths,
    else :data:`FULL`'s), ``log`` each line and the tables (None: silent), write ``json_path``
    if given; return
    ``{"machine", "load_average", "bandwidth", "gemm_rates", "rows", "rwkv_cpp"}``."""
    quick = shapes == ["tiny"]
    plan = QUICK if quick else FULL
    if not quick:
        plan = plan._replace(train_shape=plan.train_shape._replace(vocab=train_vocab))
    torch.set_num_threads(threads)
    say = log or (lambda _line: None)
    import transformers

    info = machine_info(torch.device("cpu"))
    load = load_average()
    say(f"# RWKV-4 peers: {info['cpu_model']}, {threads} threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, float32, random weights")
    say(f"load average (uptime): {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}")
    if load[0] > 0.5:
        say("WARNING: load > 0.5: the machine is not idle; these numbers are not comparable")
    if not chatrwkv_available():
        say("ChatRWKV (PyPI rwkv) not available: pip install rwkv")
    if not aftlab_available():
        say("aftlab RWKV4LM not available")
    bw = bandwidth(quick)
    say(f"memory bandwidth: {bw['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (copy "
        f"{bw['copy_bytes_per_s'] / 1e9:.1f}, add {bw['add_bytes_per_s'] / 1e9:.1f}, sum "
        f"{bw['sum_bytes_per_s'] / 1e9:.1f})")
    rows: list[dict] = []
    rates: dict[str, float] = {}
    if "train" in parts:
        s = plan.train_shape
        rates[s.name] = gemm_rate(block_gemms(s, plan.train_batch * plan.train_tokens)
                                  + [(plan.train_batch * plan.train_tokens, s.d, s.vocab)])
        say(f"GEMM rate at the training shapes: {rates[s.name] / 1e9:.1f} GFLOP/s")
        rows += train_rows(plan, repeats, rates[s.name])
    for name in shapes:
        s = SHAPES[name]
        rates[name] = gemm_rate(block_gemms(s, plan.prefill))
        say(f"{name}: GEMM rate {rates[name] / 1e9:.1f} GFLOP/s; prefill of {plan.prefill}: "
              f"{prefill_flops(s, plan.prefill) / 1e9:.1f} GFLOP, floor "
              f"{prefill_flops(s, plan.prefill) / rates[name]:.3f} s; decode floor "
              f"{1e3 * weight_bytes_per_token(s, 4) / bw['bandwidth_bytes_per_s']:.1f} ms/token")
        with tempfile.TemporaryDirectory(prefix="rwkv4-peers-") as tmp:
            hf = hf_model(s, context=max(plan.long, plan.prefill))
            peers = build_peers(hf, Path(tmp))
            fp32 = None
            if "prefill" in parts:
                rows += prefill_rows(s, peers, plan, repeats, rates[name])
            if "decode" in parts or "bf16" in parts:
                fp32 = decode_row(s, peers, plan, decode_steps, bw["bandwidth_bytes_per_s"])
                rows += [fp32] if "decode" in parts else []
            if "long" in parts:
                rows += long_rows(s, list(peers), hf, plan, threads, rates[name], Path(tmp))
            del peers
            gc.collect()
            if "bf16" in parts:
                peers = build_peers(hf, Path(tmp), dtype=torch.bfloat16)
                rows.append(decode_row(s, peers, plan, decode_steps,
                                       bw["bandwidth_bytes_per_s"], dtype=torch.bfloat16,
                                       fp32=fp32))
                del peers
            del hf
            gc.collect()
        if len(shapes) > 1:  # this shape's rows now, all of them at the end
            say(table([r for r in rows if r["shape"] == name]) + "\n")
    say(table(rows))
    for r in rows:
        for key in ("max_diff_vs_transformers", "speedup_vs_float32"):
            if r.get(key):
                say(f"{r['shape']}, {r['what'].strip()}: {key.replace('_', ' ')}: {r[key]}")
    note = rwkv_cpp_note(bw["bandwidth_bytes_per_s"], threads, info["cpu_model"])
    say(note)
    result = {"machine": info, "load_average": load, "bandwidth": bw, "gemm_rates": rates,
              "rows": rows, "rwkv_cpp": note}
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
