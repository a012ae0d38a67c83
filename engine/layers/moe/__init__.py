"""Mixture-of-experts MLPs: routing (`routing`), the experts' computation (`compute`: grouped
GEMMs on the CPU, the Triton fused-MoE kernel on CUDA), the layer holding every expert's
weights stacked (`layer`), gpt-oss's experts with biases (`biased`) and DeepSeek-V3's grouped
router with shared experts (`grouped`)."""

from engine.layers.moe.biased import BiasedExperts, BiasedMoeBlock
from engine.layers.moe.grouped import GroupedTopKRouter, SharedExpertsMoeBlock
from engine.layers.moe.layer import FusedExperts, SparseMoeBlock
from engine.layers.moe.routing import RouterSpec, Scoring, grouped_topk, route

__all__ = [
    "BiasedExperts",
    "BiasedMoeBlock",
    "FusedExperts",
    "GroupedTopKRouter",
    "RouterSpec",
    "Scoring",
    "SharedExpertsMoeBlock",
    "SparseMoeBlock",
    "grouped_topk",
    "route",
]
