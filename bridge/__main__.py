"""`python -m bridge`: the `bridge` command."""

import sys

from ._cli import main


sys.exit(main())
