"""`python -m rljob.cli`: the `rljob` command."""

import sys

from rljob.cli.main import main

sys.exit(main())
