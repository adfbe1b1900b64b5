"""`python -m router.demo`: one demo worker process."""

import sys

from router.demo.server import main

sys.exit(main())
