"""The autograder: a notebook's exercise cells become a module, each exercise's tests
run against it in a contained process, and the grade comes from a process that never
ran the student's code.

- :mod:`~distlab.grading.runner`: ``python -m distlab.grading`` (or ``distlab.grade``);
- :mod:`~distlab.grading.plugin`: the pytest plugin that streams outcomes to it;
- :mod:`~distlab.grading.sandbox`: where the student's code runs, as whom, how it ends;
- :mod:`~distlab.grading.student`: the student's module, reached only inside sandboxed ranks;
- :mod:`~distlab.grading.notebook`: exercise cells, stubs, the student release;
- :mod:`~distlab.grading.course`: the nbgrader course layout;
- :mod:`~distlab.grading.checks`: :func:`expect_close`, the comparison students read.
"""
from distlab.grading.checks import expect_close

__all__ = ["expect_close"]
