"""`python -m worker ...`: see worker.main."""

import sys

from worker.main import main

sys.exit(main())
