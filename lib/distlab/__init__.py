"""distlab: distributed LLM training, built piece by piece on NCCL, RCCL or gloo.

The packages, by role (docs/design.md is the map):

- what every lab touches: :mod:`~distlab.launch`, :mod:`~distlab.comm`,
  :mod:`~distlab.backend`, :mod:`~distlab.model`, :mod:`~distlab.data`;
- the strategies: :mod:`~distlab.collectives`, :mod:`~distlab.dp`, :mod:`~distlab.zero`,
  :mod:`~distlab.tp`, :mod:`~distlab.pp`, and :mod:`~distlab.mesh`, which lays them out on
  one rank grid;
- measuring and showing them: :mod:`~distlab.bench`, :mod:`~distlab.viz`,
  :mod:`~distlab.acceptance`;
- underneath: :mod:`~distlab.runtime` (how ranks run) and :mod:`~distlab.grading`.

The hand-built collectives keep short names, ``from distlab import ring``; each is
imported when first named.

In a student edition of the kit (:mod:`distlab.grading.edition`) the answers of the labs
whose deadline has not passed are not there, and importing them gives modules whose
names refuse (:func:`distlab.runtime.absent.install_edition`).
"""
import importlib

from distlab.runtime.absent import install_edition

install_edition()

__version__ = "0.1.0"

_SHORT = {name: f"distlab.collectives.{name}" for name in ("ring", "ps", "broadcast", "nccl_raw")}


def __getattr__(name: str):
    if name in _SHORT:
        module = importlib.import_module(_SHORT[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'distlab' has no attribute {name!r}")
