"""`python -m silo_pfl ...`: the CLI, as a Ray Job's entry point runs it."""

import sys

from silo_pfl.cli import main

sys.exit(main())
