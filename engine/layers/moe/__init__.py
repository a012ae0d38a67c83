"""Mixture-of-experts MLPs: routing (`routing`), the experts' computation (`compute`: grouped
GEMMs on the CPU, the Triton fused-MoE kernel on CUDA) and the layer holding every expert's
weights stacked (`layer`)."""

from engine.layers.moe.layer import FusedExperts, SparseMoeBlock
from engine.layers.moe.routing import RouterSpec, Scoring, route

__all__ = ["FusedExperts", "RouterSpec", "Scoring", "SparseMoeBlock", "route"]
