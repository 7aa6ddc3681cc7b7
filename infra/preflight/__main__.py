"""`python -m infra.preflight`: run the preflight checks from the command line (see cli.py)."""

from infra.preflight.cli import main

raise SystemExit(main())
