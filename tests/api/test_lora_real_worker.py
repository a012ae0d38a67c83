"""LoRA adapters end to end: the API over HTTP and a real worker on the default model (in this
process, on the API's event loop), with PEFT adapters built here. A completion on an adapter
equals offline `LLM.generate` with that adapter; adapters load and unload over HTTP while jobs
run; an adapter that cannot load (rank above max_lora_rank) fails its own job only, with
`invalid_lora_adapter`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.lora import LoRARequest
from tests.api.conftest import Stack, auth
from tests.engine.conftest import default_model_path  # noqa: F401 (a fixture)
from tests.engine.lora_reference import make_adapter
from worker.settings import WorkerSettings
from worker.worker import Worker

pytestmark = pytest.mark.model
BASE = "smol"
PROMPT = "The capital of France is"
MAX_TOKENS = 8


def greedy(llm: LLM, lora: LoRARequest | None) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


@pytest.fixture
def adapters(default_model_path: Path, tmp_path: Path) -> dict[str, Path]:  # noqa: F811
    return {
        "lora-a": make_adapter(default_model_path, tmp_path / "a", seed=1, rank=16),
        "lora-b": make_adapter(default_model_path, tmp_path / "b", seed=2, rank=8),
        "too-big": make_adapter(default_model_path, tmp_path / "big", seed=3, rank=32),
    }


@pytest.fixture
def system(
    stack: Stack,
    default_model_path: Path,  # noqa: F811
    adapters: dict[str, Path],
) -> Iterator[tuple[httpx.Client, dict[str, str]]]:
    llm = LLM(
        str(default_model_path), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16
    )
    expected = {"base": greedy(llm, None)}
    for lora_id, name in enumerate(("lora-a", "lora-b"), start=1):
        expected[name] = greedy(llm, LoRARequest(name, lora_id, str(adapters[name])))
    assert len(set(expected.values())) == 3  # each adapter changes the output
    settings = WorkerSettings(
        name="lora-worker",
        redis_url=stack.redis_url,
        model=str(default_model_path),
        served_model_name=BASE,
        enable_lora=True,
        lora_modules=[f"lora-a={adapters['lora-a']}", f"too-big={adapters['too-big']}"],
        heartbeat_interval_s=0.2,
        block_ms=50,
    )
    worker = Worker(settings, llm.engine)
    running = stack.bg.start(worker.run())
    api = stack.api(models=[], allow_runtime_lora_updating=True)
    try:
        with httpx.Client(base_url=api.url, headers=auth(), timeout=120) as http:
            give_up = time.monotonic() + 60
            while "lora-a" not in {m["id"] for m in http.get("/v1/models").json()["data"]}:
                assert time.monotonic() < give_up, "the worker did not advertise its adapters"
                time.sleep(0.1)
            yield http, expected
    finally:
        stack.bg.loop.call_soon_threadsafe(worker.request_stop, 0.0)
        running.result(60)


def complete(http: httpx.Client, model: str, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    return http.post("/v1/completions", json=body)


def test_adapters_over_http_on_the_default_model(system, adapters):
    http, expected = system
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert {k: cards[k]["parent"] for k in cards} == {BASE: None, "lora-a": BASE, "too-big": BASE}

    # a completion on an adapter equals the offline engine with that adapter
    response = complete(http, "lora-a")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected["lora-a"]
    assert complete(http, BASE).json()["choices"][0]["text"] == expected["base"]

    # an unknown adapter: 404 before queueing
    assert complete(http, "lora-b").status_code == 404

    # load lora-b over HTTP while a base job runs
    job_body = {"model": BASE, "prompt": PROMPT, "sampling": {"max_tokens": 48}}
    running = http.post("/v1/jobs", json=job_body).json()
    body = {"lora_name": "lora-b", "lora_path": str(adapters["lora-b"])}
    loaded = http.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    assert complete(http, "lora-b").json()["choices"][0]["text"] == expected["lora-b"]
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "lora-b"})
    assert unloaded.status_code == 200, unloaded.text
    assert complete(http, "lora-b").status_code == 404
    assert "lora-b" not in {m["id"] for m in http.get("/v1/models").json()["data"]}
    done = http.get(f"/v1/jobs/{running['id']}/wait", params={"timeout": 60}).json()
    assert done["status"] == "succeeded"

    # an adapter that cannot load fails its own job, not the others in the batch
    bad = http.post("/v1/jobs", json={**job_body, "model": "too-big"}).json()
    good = http.post("/v1/jobs", json={**job_body, "model": "lora-a"}).json()
    bad_done = http.get(f"/v1/jobs/{bad['id']}/wait", params={"timeout": 60}).json()
    good_done = http.get(f"/v1/jobs/{good['id']}/wait", params={"timeout": 60}).json()
    assert bad_done["status"] == "failed"
    assert bad_done["error"]["code"] == "invalid_lora_adapter"
    assert "max_lora_rank" in bad_done["error"]["message"]
    assert good_done["status"] == "succeeded"
    response = complete(http, "too-big")
    assert response.status_code == 400  # OpenAI routes answer 400 for a 422 code
    assert response.json()["error"]["code"] == "invalid_lora_adapter"
    assert complete(http, "lora-a").json()["choices"][0]["text"] == expected["lora-a"]
