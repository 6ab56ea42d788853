"""The GPU acceptance suite: named checks, each a bench of :mod:`distlab.bench` (or the
notebooks' replay, or the grader) run in a subprocess with its time limit and judged
against its goal; results as ``<check>.json`` with the environment they were measured
in, and rendered into the README.

    python -m distlab.acceptance --list
    python -m distlab.acceptance --only zero-1gpu,grader-tiers --out results/
    python -m distlab.acceptance render --results docs/results --readme README.md

The registry is :data:`distlab.acceptance.registry.REGISTRY` (the checks register when
:mod:`distlab.acceptance.checks` is imported); a check is a
:class:`distlab.acceptance.registry.Check`. Every process a check starts has NVLink
multicast off (:data:`distlab.acceptance.registry.SAFE_ENV`).
"""
