"""vLLM's run-time LoRA endpoints: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

The adapter goes into (or out of) its base model's registry hash `{p}:lora:{model}` and a
`lora` control message tells that model's workers to re-read it; the route answers once a live
worker advertises the change in its heartbeat. A worker loads the adapter's weights when a job
first asks for it: an adapter that cannot load fails that job with `invalid_lora_adapter`.
Off unless `allow_runtime_lora_updating` (any key holder could change what is served)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from producer_api.deps import ApiState, Caller, State
from producer_api.errors import ApiError, error_responses
from producer_api.workers import ServedModel
from schemas import ControlMessage, ErrorCode, JobKind
from schemas.jobs import MAX_MODEL_NAME_CHARS
from schemas.keys import LORA_UNLOADED

router = APIRouter(tags=["openai"], responses=error_responses(401))
POLL_S = 0.1


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS, pattern=r"^[^\s]+$")
    lora_path: str = Field(min_length=1, description="the PEFT folder on the workers' hosts")
    base_model_name: str | None = Field(
        None, min_length=1, description="the model it adapts; may be left out when one is served"
    )


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS)
    lora_int_id: int | None = Field(None, description="accepted as vLLM does; the name decides")


@router.post("/v1/load_lora_adapter", responses=error_responses(403, 404, 422, 503))
async def load_lora_adapter(
    body: LoadLoRAAdapterRequest, state: State, caller: Caller
) -> PlainTextResponse:
    """Serve a LoRA adapter on its base model's workers from now on."""
    _check_allowed(state)
    served = await state.workers.models()
    base = _base_model(body.base_model_name, served)
    existing = served.get(body.lora_name)
    if existing is not None and existing.parent is None:
        raise ApiError(
            ErrorCode.INVALID_REQUEST, f"lora_name: {body.lora_name!r} is a model", "lora_name"
        )
    await _announce(state, base, body.lora_name, body.lora_path)
    await _await_workers(state, body.lora_name, base)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=error_responses(403, 404, 422, 503))
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, state: State, caller: Caller
) -> PlainTextResponse:
    """Stop serving a LoRA adapter (jobs already queued for it fail with invalid_lora_adapter)."""
    _check_allowed(state)
    state.workers.forget()
    entry = (await state.workers.models()).get(body.lora_name)
    if entry is None or entry.parent is None:
        raise ApiError(
            ErrorCode.NOT_FOUND, f"lora_name: no adapter {body.lora_name!r} is served", "lora_name"
        )
    await _announce(state, entry.parent, body.lora_name, LORA_UNLOADED)
    await _await_workers(state, body.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _check_allowed(state: ApiState) -> None:
    if not state.settings.allow_runtime_lora_updating:
        raise ApiError(
            ErrorCode.FORBIDDEN,
            "loading and unloading LoRA adapters at run time is off "
            "(setting allow_runtime_lora_updating)",
        )


def _base_model(name: str | None, served: dict[str, ServedModel]) -> str:
    """The model an adapter is loaded on: the one named, else the one generation model."""
    bases = sorted(
        n for n, m in served.items() if m.parent is None and JobKind.GENERATION in m.tasks
    )
    if name is not None:
        if name not in bases:
            raise ApiError(
                ErrorCode.MODEL_NOT_FOUND,
                f"base_model_name: no live worker generates with {name!r}",
                "base_model_name",
            )
        return name
    if len(bases) != 1:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"base_model_name: name the model to adapt (served: {', '.join(bases) or 'none'})",
            "base_model_name",
        )
    return bases[0]


async def _announce(state: ApiState, base: str, name: str, path: str) -> None:
    await state.redis.hset(state.keys.lora_registry(base), name, path)  # type: ignore[misc]
    message = ControlMessage(op="lora", model=base).to_json()
    await state.redis.publish(state.keys.control_channel(), message)


async def _await_workers(state: ApiState, name: str, parent: str | None) -> None:
    """Wait until the heartbeats show adapter `name` on `parent` (None: on no model)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + state.settings.lora_update_timeout_s
    while True:
        state.workers.forget()
        entry = (await state.workers.models()).get(name)
        if (entry.parent if entry is not None else None) == parent:
            return
        if loop.time() >= give_up:
            raise ApiError(
                ErrorCode.UNAVAILABLE,
                f"no worker confirmed the change of LoRA adapter {name!r} in time; it stays "
                "registered and workers take it up at their next heartbeat",
            )
        await asyncio.sleep(POLL_S)
