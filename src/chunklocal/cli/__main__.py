"""`python -m chunklocal.cli`: the same as the `chunklocal` command."""

import sys

from chunklocal.cli import main

sys.exit(main())
