"""``python -m services.launcher ...`` is the ``meshserve`` command."""

import sys

from services.launcher.cli import main

sys.exit(main())
