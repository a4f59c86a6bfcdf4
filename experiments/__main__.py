"""Entry point: `python -m experiments run|plan|status|report STUDY.gin`."""

import sys

from experiments.cli import main

sys.exit(main())
