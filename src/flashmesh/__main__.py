"""`python -m flashmesh bench ...`: the same command as the `flashmesh` script."""

from flashmesh.bench.cli import main

raise SystemExit(main())
