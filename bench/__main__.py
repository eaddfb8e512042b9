"""Entry point of `python -m bench` (options: `python -m bench --help`)."""
import sys

from .cli import main

sys.exit(main())
