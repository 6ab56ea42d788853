"""``python -m distlab.train``."""
from distlab.train.cli import main

raise SystemExit(main())
