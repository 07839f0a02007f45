"""Every Triton kernel compiles for a GPU (NVIDIA sm_90, an H100) on a machine without one.

Triton's interpreter runs the kernels as Python over numpy, so it proves what they compute, not
that Triton's compiler accepts them: a type that changes inside a loop, a ``tl.dot`` below 16,
a constexpr used as a value all pass there and fail at the first GPU run. This test records
every kernel launch of every op (forward and backward, causal and not, padding, states,
float32 and float64) under the interpreter, with the block sizes and flags the launchers pick
on CUDA tensors, then compiles each distinct (kernel, argument types, constexprs) to PTX and
through ptxas (both ship in triton's wheel) in a process without the interpreter.
"""

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from aftlab import kernels

pytestmark = [
    pytest.mark.skipif(
        not kernels.triton.load(), reason=f"Triton kernels unavailable: {kernels.triton.error()}"
    ),
    pytest.mark.skipif(
        not kernels.triton.interpreting(), reason="records launches under the interpreter"
    ),
]

_TYPES = {torch.float32: "*fp32", torch.float64: "*fp64", torch.uint8: "*u8",
          torch.bool: "*i1", torch.int32: "*i32", torch.int64: "*i64"}


def _describe(x, constexpr: bool):
    """An argument as the compiler sees it: a constexpr's value, or a type (a pointer's, or a
    scalar's: ints that fit 32 bits are ``i32``, floats ``fp32``, as Triton's launcher types
    them)."""
    if constexpr or x is None:
        return {"value": x}
    if isinstance(x, torch.Tensor):
        return {"type": _TYPES[x.dtype]}
    if isinstance(x, bool):
        return {"type": "i1"}
    if isinstance(x, int):
        return {"type": "i32" if -(2**31) <= x < 2**31 else "i64"}
    return {"type": "fp32"}


def _is_constexpr(annotation) -> bool:
    """A ``tl.constexpr`` parameter (the annotation is a string under ``from __future__ import
    annotations``)."""
    import triton.language as tl

    return annotation is tl.constexpr or annotation in ("tl.constexpr", "constexpr")


def _record_launches(monkeypatch):
    """Run every op under the interpreter with the CUDA launch choices; the launches."""
    from triton.runtime.interpreter import InterpretedFunction

    from aftlab.kernels.triton import band, full, scan
    from aftlab.ops import aft_conv, aft_decay, aft_full, aft_local, aft_simple

    cuda = torch.device("cuda")
    for module, name in ((scan, "block"), (band, "_blocks"), (full, "blocks"), (full, "ieee")):
        choose = getattr(module, name)  # the launchers' choice for a CUDA tensor
        monkeypatch.setattr(module, name, lambda *a, choose=choose: choose(*a[:-1], cuda))
    launches = []
    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        given = dict(zip(self.arg_names, args, strict=False)) | kwargs
        launches.append({
            "module": self.fn.__module__, "name": self.fn.__name__,
            "args": {n: _describe(a, _is_constexpr(params[n].annotation))
                     for n, a in given.items()},
        })
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    B, T, d = 2, 37, 8
    pm = torch.ones(B, T, dtype=torch.bool)
    pm[0, :5] = False
    with kernels.use_kernels("triton"):
        for dtype in (torch.float32, torch.float64):
            q, k, v = (torch.randn(B, T, d, dtype=dtype, requires_grad=True) for _ in range(3))
            lam, u = torch.rand(d, dtype=dtype), torch.randn(d, dtype=dtype)
            w = torch.randn(T + 3, T + 3, dtype=dtype, requires_grad=True)
            wc = torch.randn(2, 5, dtype=dtype, requires_grad=True)  # 2 heads, kernel 5
            kc = torch.randn(B, T, 2, 1, dtype=dtype, requires_grad=True)  # a key per head
            outs = []
            for mask in (None, pm):
                for causal in (False, True):
                    outs.append(aft_simple(q, k, v, causal=causal, padding_mask=mask))
                    outs.append(aft_local(q, k, v, w, 7, causal=causal, padding_mask=mask))
                    outs.append(aft_full(q, k, v, w, causal=causal, padding_mask=mask))
                    qh, vh = q.view(B, T, 2, d // 2), v.view(B, T, 2, d // 2)
                    outs.append(aft_conv(qh, kc, vh, wc, causal=causal, padding_mask=mask))
                    # one head: one bias row for all queries, on the products
                    q1, k1, v1 = q[:, :, None], kc[:, :, :1], v[:, :, None]
                    outs.append(aft_conv(q1, k1, v1, wc[:1], causal=causal, padding_mask=mask))
                outs.append(aft_decay(q, k, v, lam, u, padding_mask=mask))
            torch.autograd.grad(sum(o.sum() for o in outs), (q, k, v, w, wc, kc))
            with torch.no_grad():  # the inference kernels: states
                _, st = aft_decay(q, k, v, lam, u, return_state=True)
                aft_decay(q[:, :1], k[:, :1], v[:, :1], lam, u, initial_state=st)
                _, st = aft_local(q, k, v, w, 7, causal=True, return_state=True)
                aft_local(q[:, :3], k[:, :3], v[:, :3], w, 7, causal=True, initial_state=st)
    return launches


_COMPILE = textwrap.dedent(
    """
    import importlib, json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = []
    for job in json.load(sys.stdin):
        fn = getattr(importlib.import_module(job["module"]), job["name"])
        sig, consts = {}, {}
        for p in fn.params:
            a = job["args"][p.name]
            if p.is_constexpr or "type" not in a:
                sig[p.name], consts[p.name] = "constexpr", a.get("value")
            else:
                sig[p.name] = a["type"]
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                               target=GPUTarget("cuda", 90, 32))
            assert k.asm.get("cubin"), "no cubin"
        except Exception as e:
            failed.append(f"{job['name']} {consts}: {type(e).__name__}: ...{str(e)[-600:]}")
    print(json.dumps(failed))
    """
)


@pytest.mark.slow
def test_every_triton_kernel_compiles_for_sm90(monkeypatch, tmp_path):
    launches = _record_launches(monkeypatch)
    jobs = {json.dumps(x, sort_keys=True): x for x in launches}  # distinct launches
    names = {x["name"] for x in jobs.values()}
    from aftlab.kernels.triton import band, full, scan

    kernels_defined = {
        n for m in (scan, band, full) for n, f in vars(m).items()
        if type(f).__name__ == "InterpretedFunction" and ("_fwd" in n or "_bwd" in n)
    }
    assert kernels_defined <= names, f"not launched: {sorted(kernels_defined - names)}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    n = max(1, min(4, os.cpu_count() or 1))  # a process per core: about 1 s a compile
    work = list(jobs.values())
    procs = [
        subprocess.Popen([sys.executable, "-c", _COMPILE], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        for _ in range(n)
    ]
    failed = []
    for i, p in enumerate(procs):
        p.stdin.write(json.dumps(work[i::n]))
        p.stdin.close()
    for p in procs:
        out, err = p.stdout.read(), p.stderr.read()
        assert p.wait(timeout=1200) == 0, err[-3000:]
        failed += json.loads(out.strip().splitlines()[-1])
    assert not failed, "\n".join(failed)
