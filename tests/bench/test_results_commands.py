"""Every command in docs/results.md's shell blocks is checked as written, and none is run:

* ``aftlab compare``: ``aftlab compare ... --dry-run`` through :func:`aftlab.cli.main` (the
  options, the config file and ``--set`` keys, the data, every ``--mixers`` entry, every model
  built on the meta device);
* ``aftlab train``: the parser, then the config it would train
  (:func:`~aftlab.cli.commands.resolve_train_config`); other ``aftlab`` commands: the parser;
* ``python benchmarks/X.py``: the script's own argparse, stopped right after parsing;
* ``bash benchmarks/X.sh``: ``bash -n`` (syntax).

The commands are those ``benchmarks/reproduce.sh`` runs (``benchmarks/results_commands.py``:
a block's shell variables expanded, ``NAME=value`` prefixes kept apart). A command of another
kind fails the test, so that a new kind is checked too.
"""

from __future__ import annotations

import argparse
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from aftlab.cli import build_parser, main
from aftlab.cli.commands import resolve_train_config

from .scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
rc = load_script("results_commands")
COMMANDS = [(c.line, list(c.words)) for c in rc.commands()]


class _Parsed(Exception):
    """Raised by the patched ``parse_args`` once a script's arguments parsed."""


def check_script(path: Path, argv: list[str], monkeypatch) -> None:
    """Run the script ``path`` as ``__main__`` up to its ``parse_args``, which must accept
    ``argv``."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    with pytest.raises(_Parsed):
        runpy.run_path(str(path), run_name="__main__")


def test_the_blocks_hold_commands_of_every_kind():
    kinds = {tuple(w[:2]) if w[0] == "aftlab" else (w[0],) for _, w in COMMANDS}
    assert {("aftlab", "compare"), ("aftlab", "train"), ("aftlab", "eval"), ("python",),
            ("bash",)} <= kinds
    expanded = [w for _, w in COMMANDS if "runs/mqar/d64-T128-att3e-4" in w]
    assert expanded and expanded[0][:4] == ["aftlab", "compare", "--config", "configs/mqar.toml"]
    prefixed = [c for c in rc.commands() if c.env]
    assert prefixed and all(c.env == ("OMP_NUM_THREADS=1",) for c in prefixed)
    assert prefixed[0].shell().startswith("OMP_NUM_THREADS=1 aftlab compare --config ")


def test_a_variable_not_assigned_in_its_block_is_named(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("## A\n\n```bash\nM=\"aftlab eval\"\n$M run\n```\n\n```bash\n$M x\n```\n")
    with pytest.raises(ValueError, match=r"results.md:9: \$M is not assigned in its block"):
        rc.commands(doc)
    doc.write_text("## A\n\n```bash\nM=\"aftlab eval\"\n$M run\n```\n")
    assert [(c.section, c.line, c.words) for c in rc.commands(doc)] == [
        ("A", 5, ("aftlab", "eval", "run"))]


def test_reproduce_selects_one_section_and_refuses_an_existing_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert rc.main(["packed documents"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [c.shell() for c in rc.commands() if c.section.startswith("Packed")]
    assert printed[0].startswith("aftlab train --config configs/text-default.toml")
    assert rc.main(["associative"]) == 0 and "bash benchmarks/mqar.sh" in capsys.readouterr().out
    assert rc.main(["no such section"]) == 2
    assert "matches no section" in capsys.readouterr().err
    assert rc.main(["rate"]) == 2  # "Text, fair: ... tuned rates", "The rate 3e-4: ..."
    assert "sections" in capsys.readouterr().err
    (tmp_path / "runs" / "r22" / "pack-aft-decay-true").mkdir(parents=True)
    assert rc.main(["packed documents"]) == 2
    assert "'runs/r22/pack-aft-decay-true' exists" in capsys.readouterr().err
    assert rc.main(["packed documents", "--continue"]) == 0
    done = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "reproduce.sh")])
    assert done.returncode == 0


@pytest.mark.parametrize("line, words", COMMANDS, ids=[f"results.md:{n}" for n, _ in COMMANDS])
def test_every_results_command_is_valid_as_written(line, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # any folder a command would create lands here, not in the repo
    for name in ("configs", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    where = f"docs/results.md:{line}: {shlex.join(words)}"
    if words[0] == "aftlab" and words[1] == "compare":
        status = main([*words[1:], "--dry-run"])
        err = capsys.readouterr().err
        assert status == 0, f"{where}\n{err}"
    elif words[0] == "aftlab":
        args = build_parser().parse_args(words[1:])
        if args.command == "train":
            resolve_train_config(args)
    elif words[0] == "python" and words[1].startswith("benchmarks/"):
        script = ROOT / words[1]
        assert script.is_file(), where
        check_script(script, words[2:], monkeypatch)
    elif words[0] == "bash":
        script = ROOT / words[1]
        assert script.is_file(), where
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{where}\n{done.stderr}"
    else:
        pytest.fail(f"{where}: no check for this kind of command here")


def test_a_stale_command_fails_the_check(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    assert main(["compare", "--config", "configs/mqar.toml", "--set", "no_such_key=1",
                 "--dry-run"]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert main(["compare", "--mixers", "attention,aft-lokal", "--dry-run"]) == 2
    assert "unknown mixer 'aft-lokal'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check_script(ROOT / "benchmarks" / "plot_sweep.py", ["--no-such-option"], monkeypatch)
    assert not any(tmp_path.glob("runs*"))  # a dry run writes nothing
