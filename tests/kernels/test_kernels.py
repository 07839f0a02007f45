"""The kernel machinery: dispatch, fallback, the module layout, the CLI and the build cache.

The op tests themselves (kernel against the float64 references) are in tests/ops, where every
test of aft_simple and aft_decay runs on both implementations; the scan kernels' own calls are
in test_scan.py.
"""

import ast
import importlib
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import aftlab.ops
from aftlab import kernels
from aftlab.cli import main
from aftlab.kernels import _build
from aftlab.ops import aft_decay, aft_simple

needs_kernels = pytest.mark.skipif(
    not kernels.load(), reason=f"kernels unavailable: {kernels.status()['aft_simple'][1]}"
)


def _inputs(B=2, T=33, d=5):
    q, k, v = (torch.randn(B, T, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    lam = torch.rand(d, dtype=torch.float64, requires_grad=True)
    u = torch.randn(d, dtype=torch.float64, requires_grad=True)
    return q, k, v, lam, u


@needs_kernels
def test_use_kernels_selects_the_implementation():
    q, k, v, lam, u = _inputs()
    with kernels.use_kernels(True):
        assert "aftlab_simple_causal" in aft_simple(q, k, v, causal=True).grad_fn.name()
        assert "aftlab_simple_global" in aft_simple(q, k, v).grad_fn.name()
        assert "aftlab_decay" in aft_decay(q, k, v, lam, u).grad_fn.name()
    with kernels.use_kernels(False):
        assert "aftlab" not in aft_simple(q, k, v, causal=True).grad_fn.name()
        assert "aftlab" not in aft_decay(q, k, v, lam, u).grad_fn.name()
    assert not kernels.enabled(torch.zeros(1, device="meta"))  # not a CPU tensor


def test_env_switch_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setenv("AFTLAB_KERNELS", "0")
    monkeypatch.setattr(kernels, "_warned", set())
    q, k, v, lam, u = _inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            y = aft_simple(q, k, v, causal=True)
            aft_decay(q, k, v, lam, u)
    assert [str(w.message) for w in caught] == [
        "aftlab: running the pure-PyTorch ops: AFTLAB_KERNELS=0"
    ]
    assert "aftlab" not in y.grad_fn.name()
    assert kernels.status()["aft_simple"] == ("torch", "switched off by AFTLAB_KERNELS=0")


_NO_COMPILER = """
import warnings, torch
from aftlab import kernels
from aftlab.ops import aft_simple
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    q = torch.randn(1, 9, 3)
    y1, y2 = aft_simple(q, q, q, causal=True), aft_simple(q, q, q)
print(len(caught), caught[0].message)
print(kernels.status()["aft_decay"])
"""


def test_no_compiler_falls_back_with_one_warning(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), AFTLAB_CACHE=str(tmp_path))
    env.pop("AFTLAB_KERNELS", None)
    out = subprocess.run(
        [sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True,
        timeout=120, check=True,
    ).stdout
    assert out.startswith("1 aftlab: running the pure-PyTorch ops: no C++ compiler"), out
    assert "('torch', 'no C++ compiler" in out
    assert not (tmp_path / "kernels").exists()  # nothing was written


@needs_kernels
def test_cli_kernels_reports_each_op(capsys, monkeypatch):
    monkeypatch.delenv("AFTLAB_KERNELS", raising=False)
    assert main(["kernels"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [f"{op} ({device})" for device in ("cpu", "cuda") for op in kernels.OPS]
    assert [line.split(":")[0] for line in lines] == rows
    cpu, cuda = lines[: len(kernels.OPS)], lines[len(kernels.OPS):]
    assert all(": cpp (compiled library " in line for line in cpu)
    for op, line in zip(kernels.OPS, cuda, strict=True):  # what a CUDA tensor would run
        triton = op in kernels.triton.OPS and kernels.triton.load()
        assert (": triton (triton " in line) == triton, line
    monkeypatch.setenv("AFTLAB_KERNELS", "0")
    assert main(["kernels"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [f"{row}: torch (switched off by AFTLAB_KERNELS=0)" for row in rows]


def test_one_module_per_source_and_the_ops_call_only_its_public_functions():
    """``kernels/<name>.py`` beside each ``csrc/<name>.cpp`` (its callers in ``__all__``, its
    fakes and autograd in ``register``); the ops reach the kernels only through those names."""
    root = Path(kernels.__file__).parent
    for cpp in sorted((root / "csrc").glob("*.cpp")):
        module = importlib.import_module(f"aftlab.kernels.{cpp.stem}")
        assert cpp.stem in kernels.__all__ and callable(module.register), cpp.name
    calls = set()
    for path in Path(aftlab.ops.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "kernels":
                    calls.add((path.name, node.attr, None))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                inner = node.value
                if isinstance(inner.value, ast.Name) and inner.value.id == "kernels":
                    calls.add((path.name, inner.attr, node.attr))
    assert calls, "no kernel calls found in aftlab/ops"
    for name, attr, fn in sorted(calls, key=str):
        assert attr in kernels.__all__, f"{name} calls kernels.{attr}, not in kernels.__all__"
        if fn is not None:
            public = getattr(kernels, attr).__all__
            assert fn in public, f"{name} calls kernels.{attr}.{fn}, not in its __all__ {public}"


_BUILD = """
import sys, torch
from aftlab import kernels
from aftlab.ops.aft_simple import aft_simple, aft_simple_reference
assert kernels.load(), kernels.status()
q = torch.randn(2, 50, 7, dtype=torch.float64)
with kernels.use_kernels(True):
    y = aft_simple(q, q, q, causal=True)
err = (y - aft_simple_reference(q, q, q, causal=True)).abs().max().item()
print("ok", err)
"""


@pytest.mark.parametrize(
    ("capability", "avx2", "avx512"),
    [("AVX512", True, True), ("AVX2", True, False), ("DEFAULT", False, False)],
)
def test_vector_flags_follow_the_cpu_capability_and_key_the_cache(
    monkeypatch, capability, avx2, avx512
):
    """AVX2 where torch reports AVX2 or AVX512, AVX-512 (F, DQ, VL, BW) only with AVX512; the
    flags enter the build key, so a cache shared by two CPUs keeps one build for each."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    flags = _build.cflags()
    assert ("-mavx2" in flags) is avx2 and ("-mfma" in flags) is avx2
    assert all((f in flags) is avx512 for f in _build.AVX512)
    assert "-march=native" not in flags
    keys = set()
    for cap in ("AVX512", "AVX2", "DEFAULT"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda cap=cap: cap)
        keys.add(_build.build_key())
    assert len(keys) == 3


@needs_kernels
@pytest.mark.slow
def test_two_processes_build_into_an_empty_cache_at_once(tmp_path):
    # A killed build leaves a temporary folder and a lock file behind; neither may block.
    env = dict(os.environ, AFTLAB_CACHE=str(tmp_path))
    env.pop("AFTLAB_KERNELS", None)
    code = "from aftlab.kernels import _build; print(_build.build_key())"
    key = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    root = tmp_path / "kernels"
    (root / f"{key}.tmpstale").mkdir(parents=True)
    (root / f"{key}.lock").touch()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_BUILD)], env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.startswith("ok") and float(out.split()[1]) < 1e-12, out
    errs = "".join(err for _, err in outs)
    assert errs.count("compiling the CPU kernels") == 1, errs  # one build, one waiter
    assert sorted(p.name for p in root.iterdir()) == [key, f"{key}.lock"]
    assert (root / key / f"{_build.NAME}.so").exists()
