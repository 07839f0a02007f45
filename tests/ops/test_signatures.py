"""aftlab.ops.signatures: the one table of each op's tensor arguments, and its readers."""

from __future__ import annotations

import inspect
import pkgutil
from functools import partial
from importlib import import_module

import aftlab.ops
from aftlab.bench import OPS
from aftlab.ops.signatures import SIGNATURES

from .test_properties import BUILD


def _public(name: str):
    """The function ``name`` that ``aftlab.ops`` or one of its modules exports, or None."""
    modules = [aftlab.ops] + [
        import_module(f"aftlab.ops.{m.name}") for m in pkgutil.iter_modules(aftlab.ops.__path__)
    ]
    return next((getattr(m, name) for m in modules if name in getattr(m, "__all__", ())), None)


def test_the_table_holds_every_public_op_with_its_arguments_in_order():
    assert set(aftlab.ops.__all__) <= set(SIGNATURES)
    for name, sig in SIGNATURES.items():
        fn = _public(name)
        assert callable(fn), f"{name} is not a public op of aftlab.ops"
        params = list(inspect.signature(fn).parameters)
        assert [p for p in params if p in sig.args] == list(sig.args), (name, params)


def test_the_property_tests_build_every_op_of_the_table():
    # aft_local_band is what aft_local calls, w given as its band: tested through aft_local
    assert set(BUILD) == set(SIGNATURES) - {"aft_local_band"}


def test_the_bench_draws_every_aft_ops_inputs_from_the_table():
    drawn = {m: op.inputs for m, op in OPS.items() if isinstance(op.inputs, partial)}
    assert set(drawn) == {m for m in OPS if m.startswith("aft-")}  # attention: SDPA's layout
    assert {f.args[0] for f in drawn.values()} <= set(SIGNATURES)
