"""``python -m distlab.grade NOTEBOOK... [--json FILE]``: grade lab notebooks (see
:mod:`distlab.grading`)."""
import sys

from distlab.grading import main

if __name__ == "__main__":
    sys.exit(main())
