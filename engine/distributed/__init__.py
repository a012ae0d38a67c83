"""Tensor parallelism: one model replica across several ranks (devices or processes).

`group` joins the ranks and holds the collectives; `launcher` starts the other ranks of a
replica and takes the replica down when one dies; `step_channel` carries each step's batch
from the driver rank (which runs the scheduler, the sampler and everything above them) to the
executor ranks; `executor` is what an executor rank runs: the model forward, step after step.
"""
