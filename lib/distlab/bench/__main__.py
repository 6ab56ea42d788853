"""``python -m distlab.bench``: the collectives sweep (:mod:`distlab.bench.collectives`)."""
from distlab.bench.collectives import main

main()
