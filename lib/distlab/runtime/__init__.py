"""How ranks run: what :mod:`distlab.launch` stands on.

- :mod:`~distlab.runtime.pool`: the warm ranks of one launch and every way it ends;
- :mod:`~distlab.runtime.rankproc`: one rank process, its pipes and its exit;
- :mod:`~distlab.runtime.forkserver`: a process that has imported torch once and forks ranks;
- :mod:`~distlab.runtime.worker`: the loop a rank runs (tasks in, answers out);
- :mod:`~distlab.runtime.plain`: the plain-data codec sandboxed ranks answer in;
- :mod:`~distlab.runtime.report`: output grouped by rank, progress bars, tidied stacks;
- :mod:`~distlab.runtime.errors`: what a failed launch raises;
- :mod:`~distlab.runtime.privileges`: dropping root for the autograder's ranks.
"""
