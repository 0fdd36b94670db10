"""schemathesis' response checks (the four the published-schema tests run) applied to one reply."""

from __future__ import annotations

import re

from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def validate(schema_obj, method: str, template: str, response) -> None:
    """schemathesis' checks of `response` as the reply to `method template` (path parameters read off the URL)."""
    response.request.read()
    names = re.findall(r"{(\w+)}", template)
    pattern = re.escape(template)
    for name in names:
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>[^/]+)")
    match = re.search(pattern + "$", response.request.url.path)
    assert match, (template, str(response.request.url))
    checks = CHECKS if response.status_code < 500 else CHECKS[1:]  # an expected 503 (/ready) is not a server error
    schema_obj[template][method].Case(path_parameters=match.groupdict()).validate_response(response, checks=checks)
