"""LoRA adapters as the API sees them: a request whose `model` names an adapter a live worker
advertises runs on that adapter's base model with it (the job carries the base model, so it is
queued on the base model's stream where any of its workers can take it, and the adapter's name
in `JobRequest.lora`)."""

from __future__ import annotations

from collections.abc import Mapping

from producer_api.errors import ApiError
from producer_api.workers import ServedModel
from schemas import ErrorCode, JobRequest


def on_base_model(
    request: JobRequest, served: Mapping[str, ServedModel], param: str = "model"
) -> JobRequest:
    """`request` as its workers take it: an adapter's name in `model` becomes the base model
    with `lora` set. A `lora` given with a base model must be one of that model's adapters
    (404 otherwise, nothing queued)."""
    entry = served.get(request.model)
    if entry is not None and entry.parent is not None:
        if request.lora not in (None, entry.name):
            raise ApiError(
                ErrorCode.INVALID_REQUEST,
                f"lora: {request.model!r} is itself an adapter; give its base model",
                "lora",
            )
        if request.pooling is not None:
            raise ApiError(
                ErrorCode.INVALID_REQUEST,
                f"{param}: {request.model!r} is a LoRA adapter; embeddings take no adapter",
                param,
            )
        return request.model_copy(update={"model": entry.parent, "lora": entry.name})
    if request.lora is not None:
        adapter = served.get(request.lora)
        if adapter is None or adapter.parent != request.model:
            raise ApiError(
                ErrorCode.MODEL_NOT_FOUND,
                f"lora: no live worker of {request.model!r} serves the adapter {request.lora!r}",
                "lora",
            )
    return request
