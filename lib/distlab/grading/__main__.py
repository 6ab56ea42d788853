"""``python -m distlab.grading NOTEBOOK... [--json FILE]``: grade lab notebooks."""
import sys

from distlab.grading.runner import main

sys.exit(main())
