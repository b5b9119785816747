"""`python -m kvstate` runs the command line."""

from kvstate.cli import main

raise SystemExit(main())
