"""The ``aftlab`` command line (being written)."""


def main(argv=None) -> int:
    raise SystemExit("aftlab: the command line is being written")
