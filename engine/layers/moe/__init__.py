"""Mixture-of-experts MLPs: routing (`routing`), the experts' computation (`compute`: grouped
GEMMs on the CPU, the Triton fused-MoE kernel on CUDA), the layer holding every expert's
weights stacked (`layer`) and gpt-oss's experts with biases (`biased`)."""

from engine.layers.moe.biased import BiasedExperts, BiasedMoeBlock
from engine.layers.moe.layer import FusedExperts, SparseMoeBlock
from engine.layers.moe.routing import RouterSpec, Scoring, route

__all__ = [
    "BiasedExperts",
    "BiasedMoeBlock",
    "FusedExperts",
    "RouterSpec",
    "Scoring",
    "SparseMoeBlock",
    "route",
]
