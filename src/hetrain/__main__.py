"""``python -m hetrain`` (what ``torchrun -m hetrain`` runs)."""

import sys

from hetrain.cli import main

sys.exit(main())
