"""Entry point: `python -m experiments SUBCOMMAND ...` (see experiments/cli.py)."""

import sys

from experiments.cli import main

sys.exit(main())
