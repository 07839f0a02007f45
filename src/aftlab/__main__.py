"""``python -m aftlab``: the same command line as ``aftlab`` (and what torchrun runs)."""

from aftlab.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
