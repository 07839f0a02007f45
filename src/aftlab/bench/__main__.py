"""``python -m aftlab.bench ...``: the same as ``aftlab bench ...``."""

import sys

from aftlab.cli import main

sys.argv[0] = "python -m aftlab.bench"
raise SystemExit(main(["bench", *sys.argv[1:]]))
