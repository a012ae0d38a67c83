"""The wire contract of inferq: jobs, sampling parameters, chunks, results, errors, Redis names."""

from schemas.sampling import SamplingParams

__all__ = ["SamplingParams"]
