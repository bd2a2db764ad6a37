"""`python -m backends.sim ...`: see backends.sim.cli."""
import sys

from backends.sim.cli import main

sys.exit(main())
