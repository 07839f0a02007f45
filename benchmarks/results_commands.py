"""The commands of docs/results.md, by section: what ``benchmarks/reproduce.sh`` runs and
tests/bench/test_results_commands.py checks.

A command is a line of a ``bash``/``sh`` block (continuations joined, comments dropped), with
the block's shell variables (``M="aftlab compare ..."``) expanded and its ``NAME=value``
prefixes (``OMP_NUM_THREADS=1``) kept apart as its environment. A section is a ``##`` or
``###`` heading; a ``###`` section holds its own blocks only.

    python benchmarks/results_commands.py --list           # the sections, with their commands
    python benchmarks/results_commands.py SECTION          # its commands, one shell line each
    python benchmarks/results_commands.py SECTION --continue

SECTION is a heading's text or a part of it that names one section (case-insensitive, e.g.
"window", "packed documents"). Unless ``--continue``, a section whose commands write into an
``--out`` folder that exists is refused (exit 2, naming it): ``aftlab compare`` would continue
that folder, not rerun from scratch.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
SHELL = re.compile(r"^```(?:bash|sh)\n(.*?)^```", re.M | re.S)
HEADING = re.compile(r"^(##|###) (.+)$", re.M)
ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)


@dataclass(frozen=True)
class Command:
    section: str  # the heading above it
    line: int  # its first line in the file
    env: tuple[str, ...]  # NAME=value prefixes
    words: tuple[str, ...]

    def shell(self) -> str:
        return shlex.join([*self.env, *self.words])


def commands(path: Path = RESULTS) -> list[Command]:
    """Every command of the shell blocks of ``path``, in order."""
    text = path.read_text(encoding="utf-8")
    heads = [(m.start(), m.group(2).strip()) for m in HEADING.finditer(text)]
    out = []
    for m in SHELL.finditer(text):
        section = next((h for pos, h in reversed(heads) if pos < m.start()), "")
        first = text[: m.start(1)].count("\n") + 1
        variables: dict[str, str] = {}
        pending, start = "", 0
        for n, raw in enumerate(m.group(1).split("\n")):
            if not pending:
                start = first + n
            if raw.endswith("\\"):
                pending += raw[:-1] + " "
                continue
            line, pending = pending + raw, ""
            for name in re.findall(r"\$(\w+)", line):
                if name not in variables:
                    raise ValueError(f"{path.name}:{start}: ${name} is not assigned in its block")
            line = re.sub(r"\$(\w+)", lambda v, env=variables: env[v.group(1)], line)
            words = shlex.split(line, comments=True)
            if len(words) == 1 and (a := ASSIGN.match(words[0])):
                variables[a.group(1)] = a.group(2)
                continue
            k = 0
            while k < len(words) and ASSIGN.match(words[k]):
                k += 1
            if k < len(words):
                out.append(Command(section, start, tuple(words[:k]), tuple(words[k:])))
    return out


def select(cmds: list[Command], name: str) -> list[Command]:
    """The commands of the one section whose heading is ``name`` or contains it
    (case-insensitive); ``ValueError`` naming the candidates otherwise."""
    sections = list(dict.fromkeys(c.section for c in cmds))
    exact = [s for s in sections if s.lower() == name.lower()]
    found = exact or [s for s in sections if name.lower() in s.lower()]
    if len(found) != 1:
        what = "matches no section" if not found else f"matches {len(found)} sections"
        raise ValueError(f"SECTION {name!r} {what}; the sections: {'; '.join(found or sections)}")
    return [c for c in cmds if c.section == found[0]]


def outs(cmds: list[Command]) -> list[str]:
    """The ``--out`` folders the commands write."""
    return [c.words[i + 1] for c in cmds for i, w in enumerate(c.words[:-1]) if w == "--out"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("section", nargs="?", metavar="SECTION")
    p.add_argument("--list", action="store_true", help="the sections and their commands")
    p.add_argument("--continue", dest="cont", action="store_true",
                   help="allow --out folders that exist (compare continues them)")
    a = p.parse_args(argv)
    cmds = commands()
    if a.list or a.section is None:
        for section in dict.fromkeys(c.section for c in cmds):
            print(f"{section}: {sum(c.section == section for c in cmds)} command(s)")
        return 0
    try:
        chosen = select(cmds, a.section)
    except ValueError as e:
        print(f"results_commands.py: error: {e}", file=sys.stderr)
        return 2
    there = [o for o in outs(chosen) if Path(o).exists()]
    if there and not a.cont:
        print(f"results_commands.py: error: --out {there[0]!r} exists: aftlab compare would "
              "continue it, not rerun from scratch (remove it, or pass --continue)",
              file=sys.stderr)
        return 2
    for c in chosen:
        print(c.shell())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
