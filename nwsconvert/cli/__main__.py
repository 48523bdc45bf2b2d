"""``python -m nwsconvert.cli ...`` (and ``torchrun -m nwsconvert.cli ...``) runs ``nws-train``."""

import sys

from .train import train_main

sys.exit(train_main())
