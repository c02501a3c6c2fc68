"""Property-based run of the whole API from its own /openapi.json (schemathesis strategies driven
by hypothesis): whatever the generated request, the server answers without a 5xx, with a
documented status and a body matching the documented schema."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from tests.server.test_harness import ServerProcess, shared_server

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

#: positive_data_acceptance is left out: a schema cannot say "a decodable image", so schema-valid
#: requests are rightly refused with 422 (the image bytes are checked, not only their type)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

EXAMPLES = 25  # generated requests per operation


@pytest.fixture(scope="module")
def srv(request: pytest.FixtureRequest) -> ServerProcess:
    return shared_server(request)


def test_no_5xx_and_documented_answers(srv: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    for op in operations:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy())
        def run(case) -> None:
            case.call_and_validate(base_url=srv.url, checks=CHECKS, timeout=120)

        run()
    assert srv.health()[0] == 200
