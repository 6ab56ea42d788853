"""``python -m distlab.grade``: the grader's older name, kept working (see
:mod:`distlab.grading`, ``python -m distlab.grading``)."""
import sys

from distlab.grading.cli import main

if __name__ == "__main__":
    sys.exit(main())
