"""Failures at scale (lab 12): what they cost (``failures``), every rank's flight record
and the hangs it names (``flight``), replicas that agree on a quorum at every step and
survive a dead one (``quorum``, ``replicas``) against checkpoint and restart under
torchrun (``restart``), and silent data corruption found by replay (``sdc``). The lab's
answers live in ``divergence`` and ``recovery``."""
from distlab.resilience.failures import LLAMA3, daly_interval, goodput, mtbf_s, young_interval
from distlab.resilience.quorum import Manager, Quorum, ReplicaLost, lighthouse

__all__ = ["LLAMA3", "Manager", "Quorum", "ReplicaLost", "daly_interval", "goodput",
           "lighthouse", "mtbf_s", "young_interval"]
