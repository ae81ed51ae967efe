"""`python -m amoe` runs the `amoe` command."""

import sys

from amoe.cli import main

sys.exit(main())
