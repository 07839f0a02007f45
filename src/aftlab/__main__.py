from aftlab.cli import main

raise SystemExit(main())
