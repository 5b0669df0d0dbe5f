"""The OpenAPI document is served and matches what the server does (schemathesis).

schemathesis generates requests for every operation of /openapi.json, valid ones and invalid
ones, sends them to a real server over HTTP and checks every answer: no 5xx, only documented
status codes, headers and bodies matching their schemas, invalid input refused with a 4xx.
(Driven through hypothesis directly: schemathesis' pytest loader does not run on pytest 9.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from agent.ingest.http.openapi import openapi_document
from tests.http.harness import Served

OPERATIONS: list[Any] = [
    result.ok() for result in  # type: ignore[union-attr]
    schemathesis.openapi.from_dict(openapi_document()).get_all_operations()]
CASES = [pytest.param(op, GenerationMode.POSITIVE, id=f"{op.label} valid") for op in OPERATIONS]
# Invalid requests only exist for operations that take some input.
CASES += [pytest.param(op, GenerationMode.NEGATIVE, id=f"{op.label} invalid")
          for op in OPERATIONS
          if len(op.body) or len(op.path_parameters) or len(op.headers) or len(op.query)]


def test_openapi_document_is_served(served: Served) -> None:
    doc = served.client.get("/openapi.json").json()
    assert doc == openapi_document()
    assert {"/topics/{topic}", "/topics/{topic}/batch", "/topics", "/status/ping",
            "/status/health", "/status/ready"} <= set(doc["paths"])
    publish = doc["paths"]["/topics/{topic}"]["post"]["responses"]
    assert {"201", "202", "400", "404", "408", "413", "415", "429", "503"} <= set(publish)


TOKEN = "openapi-token"


@pytest.fixture
def api_url(serve: Callable[..., Served]) -> str:
    served = serve(topics={
        "default": {"ack_timeout_ms": 0},
        "fixed": {"ack_timeout_ms": 0, "content_type": "json"},
    }, http={"management_token": TOKEN})
    return served.url


@pytest.mark.parametrize(("operation", "mode"), CASES)
def test_api_conforms_to_its_openapi_document(
        api_url: str, operation: Any, mode: GenerationMode) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=25, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        # Every other check runs. Not "schema-valid requests are accepted": some refusals
        # depend on content or state no OpenAPI schema can express (an Avro schema that
        # does not parse, an Idempotency-Key reused for another body: 400, 422).
        case.call_and_validate(base_url=api_url, excluded_checks=[positive_data_acceptance],
                               headers={"Authorization": f"Bearer {TOKEN}"})

    check()
