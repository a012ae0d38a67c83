"""`python -m cli ...`: the same as `inferq ...` (what `inferq up` runs its children with)."""

import sys

from cli.main import main

sys.exit(main())
