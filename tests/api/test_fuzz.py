"""Schemathesis fuzzing of the published OpenAPI schema: no 5xx, whatever the request, and
every status answered is one the schema documents for that operation.

Every operation gets generated requests (valid and invalid per the schema); each JSON body
that names a model is sent a second time naming the model the echo worker serves, so the
fuzzing reaches past the 404 into validation, queueing, waiting and streaming. Bounded (about
10 s), so it runs in the default suite and in CI."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import status_code_conformance

from tests.api.conftest import MODEL, auth

EXAMPLES_PER_OPERATION = 50
MIN_REQUESTS = 500


def test_fuzzing_the_openapi_schema_gives_no_5xx_and_only_documented_statuses(stack):
    api = stack.api(request_timeout_s=20.0, max_wait_s=2.0)
    stack.worker(max_model_len=4096)
    schema = schemathesis.openapi.from_url(api.url + "/openapi.json")
    sent: list[tuple[str, str, int]] = []

    def send(case) -> None:
        response = case.call(base_url=api.url, headers=auth(), timeout=60)
        sent.append((case.method, case.path, response.status_code))
        assert response.status_code < 500, (
            case.method,
            case.formatted_path,
            case.body,
            response.text,
        )
        case.validate_response(response, checks=[status_code_conformance])

    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case) -> None:
            if isinstance(case.query, dict) and "timeout" in case.query:
                case.query["timeout"] = min(float(case.query["timeout"]), 2.0)
            send(case)
            if isinstance(case.body, dict) and "model" in case.body:
                case.body = {**case.body, "model": MODEL}
                send(case)

        fuzz()
    assert len(sent) >= MIN_REQUESTS
    statuses = {status for _, _, status in sent}
    assert statuses & {200, 202}, "some generated requests must succeed"
