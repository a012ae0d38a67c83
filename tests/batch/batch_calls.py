"""The Batch API calls the batch tests make, over a system's authenticated `http` client."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx


class BatchCalls:
    """Mixed into a test system that holds an authenticated `http` client of the API."""

    http: httpx.Client
    wait_timeout_s = 60.0
    poll_s = 0.1

    def upload(self, text: str, name: str = "input.jsonl") -> dict[str, Any]:
        response = self.http.post(
            "/v1/files", files={"file": (name, text.encode())}, data={"purpose": "batch"}
        )
        assert response.status_code == 200, response.text
        return response.json()

    def create(self, file_id: str, endpoint: str = "/v1/completions", **extra: Any) -> dict:
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
        response = self.http.post("/v1/batches", json={**body, **extra})
        assert response.status_code == 200, response.text
        return response.json()

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self.http.get(f"/v1/batches/{batch_id}").json()

    def wait(
        self, batch_id: str, statuses: set[str], timeout: float | None = None
    ) -> dict[str, Any]:
        give_up = time.monotonic() + (timeout or self.wait_timeout_s)
        while (batch := self.batch(batch_id))["status"] not in statuses:
            assert time.monotonic() < give_up, f"batch stuck at {batch}"
            time.sleep(self.poll_s)
        return batch

    def content(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        response = self.http.get(f"/v1/files/{file_id}/content")
        assert response.status_code == 200, response.text
        return [json.loads(line) for line in response.text.splitlines()]
