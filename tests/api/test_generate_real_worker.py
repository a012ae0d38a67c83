"""`/generate` and beam search over the queue against a real worker on the default model: a
beam-search request answers its beams, best first, equal to the offline engine's beam search,
and `/v1/completions` with vLLM's `use_beam_search` gives the same beams."""

from __future__ import annotations

import httpx
import pytest

from engine import LLM, BeamSearchParams
from tests.api.conftest import auth
from tests.api.test_grpc_real_worker import MAX_MODEL_LEN, MODEL, real_system

pytestmark = [pytest.mark.slow, pytest.mark.model]

PROMPT = "The capital of France is"
BEAMS = 3
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    # float32 on both sides: dtype auto is measured per process and bf16 near-ties move beams
    with real_system(tmp_path_factory, "--dtype", "float32") as running:
        yield running


@pytest.fixture(scope="module")
def offline_beams() -> list[str]:
    llm = LLM(MODEL, dtype="float32", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    params = BeamSearchParams(beam_width=BEAMS, max_tokens=MAX_TOKENS)
    return [output.text for output in llm.beam_search([PROMPT], params)[0].outputs]


def test_generate_beam_search_equals_the_offline_engine(system, offline_beams):
    stack, _ = system
    body = {
        "prompt": PROMPT,
        "n": BEAMS,
        "use_beam_search": True,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    with httpx.Client(base_url=stack.servers[0].url, headers=auth(), timeout=120) as http:
        generated = http.post("/generate", json=body)
        completed = http.post(
            "/v1/completions",
            json={"model": MODEL, **{k: v for k, v in body.items() if k != "prompt"},
                  "prompt": PROMPT},
        )  # fmt: skip
        seeded = http.post(
            "/generate",
            json={"prompt": PROMPT, "n": 1, "use_beam_search": False, "temperature": 0.7,
                  "max_tokens": 10},
        )  # fmt: skip
    assert generated.status_code == 200, generated.text
    assert generated.json()["text"] == [PROMPT + text for text in offline_beams]
    assert len(set(offline_beams)) == BEAMS
    assert completed.status_code == 200, completed.text
    assert [choice["text"] for choice in completed.json()["choices"]] == offline_beams
    assert seeded.status_code == 200, seeded.text
    assert seeded.json()["text"][0].startswith(PROMPT)
