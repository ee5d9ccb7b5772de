"""``python -m hetrain.emulate run|up|down|status ...``: as ``hetrain emulate``."""

import sys

from hetrain.emulate.cli import main

sys.exit(main())
