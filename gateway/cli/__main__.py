"""`python -m specgate.gateway.cli`: the specgate command."""

from specgate.gateway.cli.main import main

raise SystemExit(main())
