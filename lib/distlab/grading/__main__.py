"""``python -m distlab.grading NOTEBOOK|FOLDER... [--lab N] [--json FILE]``: grade lab notebooks."""
import sys

from distlab.grading.cli import main

sys.exit(main())
