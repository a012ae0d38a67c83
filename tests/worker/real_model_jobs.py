"""Greedy jobs on the default model for the slow real-engine worker tests: prompts, their
offline reference outputs, and enqueueing them."""

from __future__ import annotations

from engine import SamplingParams
from producer_api.client.redis_client import AsyncRedisClient
from schemas import Job

MODEL = "SmolLM2-135M-Instruct"


def note_prompts(count: int) -> list[str]:
    return [f"Write a short note number {i} about {'rivers ' * (1 + i % 5)}" for i in range(count)]


def greedy_params(max_tokens: int) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}


def reference(llm, prompts: list[str], max_tokens: int) -> list[tuple[list[int], str]]:
    params = SamplingParams(**greedy_params(max_tokens))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]


async def enqueue(client: AsyncRedisClient, prompts: list[str], max_tokens: int) -> list[Job]:
    return [
        await client.enqueue(model=MODEL, prompt=p, stream=True, sampling=greedy_params(max_tokens))
        for p in prompts
    ]
