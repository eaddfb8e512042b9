"""`python -m hermes`: see `hermes.cli`."""
from hermes.cli import main

raise SystemExit(main())
