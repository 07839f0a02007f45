"""Running one case: set it up, warm it up, measure its peak memory and its median time.

On CPU, :func:`run_isolated` runs each case in a fresh process forked from a server that has
already imported torch (``multiprocessing``'s ``forkserver``), so a case starts from a clean
heap without paying for ``import torch`` each time.

Peak memory:
    * CPU: after set-up and warm-up the process's resident-set high-water mark is reset
      (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0), then one call runs and the peak is
      ``VmHWM - VmRSS(before the call)``: the memory the call itself needs above its inputs.
      glibc's ``malloc`` is told to serve every block over 128 KiB with ``mmap`` (a fixed
      ``M_MMAP_THRESHOLD``), so freed tensors go back to the system and cannot hide a later
      allocation.
    * CUDA: ``torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()`` around the
      call, after ``reset_peak_memory_stats``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from .cases import CASES, MATMUL_CASE, OpCase, Shape
from .machine import synchronize, timed

__all__ = [
    "can_isolate",
    "CaseSpec",
    "run_case",
    "run_isolated",
    "tensor_bytes",
    "read_status_kib",
    "COMPARE_BUILDERS",
    "PEERS",
    "WKV",
]


SLOW_CALL_S = 1.0


@dataclass(frozen=True)
class CaseSpec:
    """Everything a (possibly separate) process needs to run one case."""

    name: str
    mode: str
    causal: bool
    shape: Shape
    dtype: str
    device: str
    threads: int
    repeats: int
    warmup: int
    max_seconds: float
    seed: int = 0


# ----------------------------------------------------------------------------- memory probes
def read_status_kib(key: str) -> int | None:
    """``/proc/self/status`` field ``key`` (e.g. ``"VmHWM"``) in KiB, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _fixed_mmap_threshold() -> None:
    """Serve allocations over 128 KiB by mmap, returned to the system on free (glibc only)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def tensor_bytes(obj: Any, _seen: set[int] | None = None) -> int:
    """Bytes held by the tensors inside ``obj`` (dataclasses, dicts, lists, tuples), each once."""
    seen = set() if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return sum(tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


def _peak_memory(fn, device: torch.device) -> tuple[int | None, str, float]:
    """Run ``fn`` once; return (peak bytes above the state before the call, method, seconds)."""
    gc.collect(1)  # the young generations: enough to drop the previous call's cycles, and cheap
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        seconds = timed(fn, device)
        peak = torch.cuda.max_memory_allocated(device) - base
        return peak, "cuda max_memory_allocated", seconds
    if not _reset_peak_rss():
        return None, "unavailable (no /proc/self/clear_refs)", timed(fn, device)
    base = read_status_kib("VmRSS")
    seconds = timed(fn, device)
    peak = read_status_kib("VmHWM")
    return max(0, (peak - base) * 1024), "VmHWM - VmRSS", seconds


# ----------------------------------------------------------------------------- set-ups
def _find_case(name: str) -> OpCase:
    if name == MATMUL_CASE.name:
        return MATMUL_CASE
    return CASES[name]


def _op_callable(case: OpCase, spec: CaseSpec, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(spec.seed)
    inputs = case.make_inputs(spec.shape, spec.causal, dtype, device, gen)
    if spec.mode == "forward":

        def fn():
            with torch.no_grad():
                return case.op(inputs, spec.causal)

        return fn, {}
    leaves = {n: t.requires_grad_(True) for n, t in inputs.items() if t.is_floating_point()}
    with torch.no_grad():
        dy = torch.randn_like(case.op(inputs, spec.causal))

    def fn():
        y = case.op(inputs, spec.causal)
        return torch.autograd.grad(y, list(leaves.values()), dy)

    return fn, {}


def _decode_callable(
    case: OpCase, spec: CaseSpec, device: torch.device, dtype: torch.dtype, deadline: float
):
    """A module of ``case.mixer`` with its state advanced to position ``T``; ``fn`` = one step.

    The state is built by the mixer's ``prefill(x) -> (y, state)`` when it has one, else by
    ``T`` steps under ``inference_mode`` (aborted past the case's time budget). Each timed call
    advances the position by one, so steps are timed at positions ``T, T+1, ...``.
    """
    from aftlab.mixers import build_mixer

    s = spec.shape
    extra = spec.warmup + spec.repeats + 8
    torch.manual_seed(spec.seed)
    m = (
        build_mixer(
            case.mixer,
            d_model=s.d,
            n_heads=s.h,
            causal=True,
            max_seq_len=s.T + extra,
            **case.mixer_options,
        )
        .to(device=device, dtype=dtype)
        .eval()
    )
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.inference_mode():
        x = torch.randn(s.B, s.T + extra, s.d, generator=gen).to(device=device, dtype=dtype)
        prefill = getattr(m, "prefill", None)
        if callable(prefill) and s.T > 0:
            _, state = prefill(x[:, : s.T])
        else:
            state = m.init_state(s.B, device=device, dtype=dtype)
            for t in range(s.T):
                _, state = m.step(x[:, t], state)
                if t % 64 == 63 and time.perf_counter() > deadline:
                    raise TimeoutError(
                        f"building the decoding state by {t + 1} of {s.T} steps exceeded the "
                        f"{spec.max_seconds:g} s budget"
                    )
    box = {"state": state, "t": s.T}

    def fn():
        with torch.inference_mode():
            y, box["state"] = m.step(x[:, box["t"]], box["state"])
        box["t"] += 1
        return y

    return fn, {"state_bytes": tensor_bytes(state)}


def _module_compare_callable(spec: CaseSpec, device: torch.device, dtype: torch.dtype):
    """Module-level comparison cases ``"cmp:<impl>:<variant>"`` (see :data:`COMPARE_BUILDERS`)."""
    s = spec.shape
    torch.manual_seed(spec.seed)
    module = COMPARE_BUILDERS[spec.name](s).to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(spec.seed)
    x = torch.randn(s.B, s.T, s.d, generator=gen).to(device=device, dtype=dtype)
    info = {}
    with torch.no_grad():
        info["finite"] = bool(torch.isfinite(module(x)).all())
        info["finite_large_input"] = bool(torch.isfinite(module(x * 1000.0)).all())
    if spec.mode == "forward":

        def fn():
            with torch.no_grad():
                return module(x)

        return fn, info
    leaves = [x.requires_grad_(True), *module.parameters()]
    dy = torch.randn(s.B, s.T, s.d, generator=gen).to(device=device, dtype=dtype)

    def fn():
        return torch.autograd.grad(module(x), leaves, dy)

    return fn, info


def _aftlab_module(name: str):
    def build(s: Shape):
        from aftlab.mixers import build_mixer

        return build_mixer(name, d_model=s.d, n_heads=1, causal=False, max_seq_len=s.T)

    return build


def _aft_pytorch_module(cls_name: str):
    def build(s: Shape):
        import aft_pytorch

        return getattr(aft_pytorch, cls_name)(max_seqlen=s.T, dim=s.d, hidden_dim=s.d)

    return build


class WKV(torch.nn.Module):
    """RWKV's WKV on keys = values = ``x (B, T, d)``, by ``impl`` (``"aftlab"`` or ``"hf-rwkv"``).

    ``Y_t = sum_{t'<t} e^{-(t-1-t') lambda + K_t'} V_t' + e^{u + K_t} V_t`` over the same sum of
    weights, with ``lambda = exp(time_decay)`` and ``u = time_first`` (per channel): aftlab's
    ``aft_decay(q, k, v, decay=lambda, bonus=u)`` with ``q = 30`` (``sigma(30) = 1`` in float32),
    and transformers' ``rwkv_linear_attention_cpu(time_decay, time_first, k, v)``.
    """

    def __init__(self, s: Shape, impl: str):
        super().__init__()
        self.impl = impl
        self.time_decay = torch.nn.Parameter(torch.linspace(-3.0, 0.0, s.d))
        self.time_first = torch.nn.Parameter(torch.linspace(-0.5, 0.5, s.d))
        self.register_buffer("q", torch.full((s.B, s.T, s.d), 30.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "hf-rwkv":
            from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

            return rwkv_linear_attention_cpu(self.time_decay, self.time_first, x, x)[0]
        from aftlab.ops.aft_decay import aft_decay

        return aft_decay(self.q, x, x, self.time_decay.exp(), self.time_first)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The float64 per-position ``aft_decay_reference`` of the same WKV."""
        from aftlab.ops.aft_decay import aft_decay_reference

        return aft_decay_reference(self.q, x, x, self.time_decay.exp(), self.time_first)


#: Module-level comparison cases ``"cmp:<impl>:<variant>"``: ``aft-pytorch``'s AFTFull and
#: AFTSimple beside our mixers (non-causal, width d, one head), transformers' RWKV CPU path
#: beside our aft-decay (causal, the :class:`WKV` above).
COMPARE_BUILDERS = {
    "cmp:aftlab:aft-full": _aftlab_module("aft-full"),
    "cmp:aft-pytorch:AFTFull": _aft_pytorch_module("AFTFull"),
    "cmp:aftlab:aft-simple": _aftlab_module("aft-simple"),
    "cmp:aft-pytorch:AFTSimple": _aft_pytorch_module("AFTSimple"),
    "cmp:aftlab:aft-decay": lambda s: WKV(s, "aftlab"),
    "cmp:hf-rwkv:rwkv_linear_attention_cpu": lambda s: WKV(s, "hf-rwkv"),
}

#: The peers: the module they need, how to install it, and (ours, theirs) variant pairs.
PEERS = {
    "aft-pytorch": (
        "aft_pytorch",
        "aft-pytorch",
        (("aft-full", "AFTFull"), ("aft-simple", "AFTSimple")),
    ),
    "hf-rwkv": ("transformers", "transformers", (("aft-decay", "rwkv_linear_attention_cpu"),)),
}


# ----------------------------------------------------------------------------- one case
def _tiny_shape(s: Shape) -> Shape:
    return Shape(1, min(s.T, 4), s.h * min(s.c, 2), s.h, s.esize)


def _build(spec: CaseSpec, case: OpCase | None, device, dtype, deadline: float):
    if spec.name.startswith("cmp:"):
        return _module_compare_callable(spec, device, dtype)
    case = case if case is not None else _find_case(spec.name)
    if spec.mode == "decode":
        return _decode_callable(case, spec, device, dtype, deadline)
    return _op_callable(case, spec, device, dtype)


def run_case(spec: CaseSpec, case: OpCase | None = None) -> dict:
    """Set up, warm up, measure peak memory once, then time up to ``repeats`` calls.

    The number of timed calls is cut so the case stays within ``max_seconds`` (at least one).
    A call slower than :data:`SLOW_CALL_S` is warmed up once, and that warm-up call gives the
    peak memory; faster ones get ``warmup`` warm-up calls and a separate memory call.

    Returns:
        ``{"status": "ok", "times": [...], "peak_bytes", "mem_method", ...}`` or
        ``{"status": "skipped" | "error", "note": ...}``.
    """
    t_start = time.perf_counter()
    deadline = t_start + spec.max_seconds
    torch.set_num_threads(spec.threads)
    device, dtype = torch.device(spec.device), getattr(torch, spec.dtype)
    try:
        # Prime: one call of the same computation at a tiny size first, so one-time costs
        # (library initialisation, thread pools, kernel buffers kept for reuse) are paid before
        # the measured calls and counted in neither their time nor their memory.
        tiny = dataclasses.replace(spec, shape=_tiny_shape(spec.shape), max_seconds=float("inf"))
        _build(tiny, case, device, dtype, float("inf"))[0]()
        fn, info = _build(spec, case, device, dtype, deadline)
        t_setup = time.perf_counter() - t_start
        # The first call is a warm-up. It is also the memory measurement when it is slow
        # (>= SLOW_CALL_S: one-time costs are then negligible), so a slow case costs two calls.
        peak, method, first = _peak_memory(fn, device)
        if first < SLOW_CALL_S:
            for _ in range(spec.warmup - 1):
                timed(fn, device)
            peak, method, _ = _peak_memory(fn, device)
        times = [timed(fn, device)]
        while (
            len(times) < spec.repeats and time.perf_counter() + statistics.median(times) < deadline
        ):
            times.append(timed(fn, device))
    except TimeoutError as e:
        return {"status": "skipped", "note": str(e)}
    except NotImplementedError as e:
        return {"status": "skipped", "note": f"not implemented yet: {e}"}
    except torch.OutOfMemoryError as e:
        return {"status": "skipped", "note": f"out of memory: {str(e).splitlines()[0]}"}
    except Exception as e:  # reported per case: one broken mixer must not stop the run
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return {"status": "error", "note": last}
    out = {
        "status": "ok",
        "times": times,
        "first_call_s": first,
        "pid": os.getpid(),
        "setup_s": t_setup,
        "peak_bytes": peak,
        "mem_method": method,
    }
    out.update(info)
    return out


def _child(spec: CaseSpec, conn) -> None:
    _fixed_mmap_threshold()
    try:
        conn.send(run_case(spec))
    finally:
        conn.close()


_CTX: Any = None


def _context():
    global _CTX
    if _CTX is None:
        methods = mp.get_all_start_methods()
        _CTX = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if _CTX.get_start_method() == "forkserver":
            _CTX.set_forkserver_preload(["aftlab.bench.measure", "aftlab.mixers"])
    return _CTX


def can_isolate() -> bool:
    """Whether a child process can start: ``multiprocessing`` re-imports the main script, so a
    main read from stdin or ``-c`` (a path that does not exist) rules it out."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return getattr(main, "__spec__", None) is not None or path is None or os.path.exists(path)


def run_isolated(spec: CaseSpec, *, timeout: float) -> dict:
    """:func:`run_case` in a fresh process; a crash or a time-out becomes a reported note."""
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(spec, child), daemon=True)
    p.start()
    child.close()
    try:
        if parent.poll(timeout):
            try:
                return parent.recv()
            except EOFError:
                pass
            p.join(5)
            return {
                "status": "error",
                "note": f"case process died (exit code {p.exitcode}; out of memory?)",
            }
        return {"status": "skipped", "note": f"exceeded the hard time limit of {timeout:.0f} s"}
    finally:
        if p.is_alive():
            p.kill()
        p.join(5)
        parent.close()
