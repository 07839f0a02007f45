"""``python -m aftlab.bench ...``: the benchmark on its own (same options as ``aftlab bench``)."""

from aftlab.bench.cli import main

raise SystemExit(main())
