"""`python -m nanosched.cli ...`: the same command line as the `nanosched` script."""

import sys

from nanosched.cli import main

sys.exit(main())
