"""``python -m distlab.acceptance``: see :mod:`distlab.acceptance.cli`."""
import sys

from distlab.acceptance.cli import main

sys.exit(main())
