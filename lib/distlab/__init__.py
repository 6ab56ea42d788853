"""distlab: distributed LLM training, built piece by piece on NCCL, RCCL or gloo.

One module per concept; see the README for the map and DESIGN.md for the conventions.
"""
__version__ = "0.1.0"
