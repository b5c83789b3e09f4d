"""`python -m llmgw.sim`: run the sim engine."""

import sys

from llmgw.sim.server import main

sys.exit(main())
