"""/openapi.json says what the server answers: every route has an entry in serve/openapi.py's table, errors
are OpenAI's error object (never FastAPI's 422 validation body), and the bodies routes read by hand are
described. Real replies of an in-process app are checked against the schema with schemathesis' own checks
(tests/test_openapi_conformance.py fuzzes the demo server)."""

from __future__ import annotations

import types

import pytest
import schemathesis
from fastapi.testclient import TestClient
from schemathesis.core.failures import FailureGroup

from pipelines.config import RealtimeConfig
from serve.app import create_app
from serve.openapi import OPERATIONS, build_schema, schema_routes
from serve.routes.videos import VideoBody
from serve.schemas import ImageEditRequest
from stages.metrics import Metrics
from tests.schema_checks import validate

ERROR_REF = {"$ref": "#/components/schemas/Error"}
UNAUTHENTICATED = {("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/v1/files/images/{name}")}


def _engine():
    """What create_app and the system routes read of an engine: no models, not ready."""
    return types.SimpleNamespace(config=types.SimpleNamespace(realtime=RealtimeConfig(), models=(), voices=()),
                                 metrics=Metrics(), models={}, ready=False, load_error=None)


@pytest.fixture
def app(tmp_path):
    return create_app(_engine(), api_keys={"sk-test": "alice"}, data_dir=tmp_path, admin_key="admin-test")


@pytest.fixture
def schema(app):
    return app.openapi()


def _operations(schema):
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            yield method.upper(), path, op


def test_every_route_has_an_entry_and_every_entry_a_route(app):
    """A route added without an entry in serve/openapi.py OPERATIONS fails here (its schema would be a guess)."""
    routes = {(method, path) for method, path, _ in schema_routes(app)}
    assert routes, "no routes found: schema_routes no longer sees the app's routes"
    assert routes - set(OPERATIONS) == set(), "routes without an entry in serve/openapi.py OPERATIONS"
    assert set(OPERATIONS) - routes == set(), "entries in serve/openapi.py OPERATIONS for routes that do not exist"


def test_a_route_without_an_entry_is_noticed(app):
    """The check above sees routes included later too (the table is keyed by what FastAPI publishes)."""
    @app.get("/v1/not-described")
    async def not_described() -> dict:
        return {}

    assert ("GET", "/v1/not-described") in {(m, p) for m, p, _ in schema_routes(app)} - set(OPERATIONS)


def test_errors_are_the_error_object_and_never_fastapis_422(schema):
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for method, path, op in _operations(schema):
        responses = op["responses"]
        # 422: idempotency_key_reused
        assert "422" not in responses or path in ("/v1/videos", "/v1/batches"), f"{method} {path} documents 422"
        assert "500" in responses, f"{method} {path}"
        for status, response in responses.items():
            if int(status) >= 400 and (method, path, status) != ("GET", "/ready", "503"):
                assert response["content"] == {"application/json": {"schema": ERROR_REF}}, f"{method} {path} {status}"
    error = schema["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_key_routes_document_401_and_bearer_auth(schema):
    for method, path, op in _operations(schema):
        if (method, path) in UNAUTHENTICATED:
            assert "401" not in op["responses"], f"{method} {path}"
        else:
            assert "401" in op["responses"] and {"bearerAuth": []} in op["security"], f"{method} {path}"
    for path in ("/health", "/ready", "/metrics"):
        assert "security" not in schema["paths"][path]["get"], path
    image = schema["paths"]["/v1/files/images/{name}"]["get"]  # a signed link, or the owner's key
    assert image["security"] == [{"bearerAuth": []}, {}] and "403" in image["responses"]
    assert {p["name"] for p in image["parameters"]} == {"name", "expires", "sig"}
    assert schema["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer", "description": "An API key, when the server has --api-keys"}


def test_bodies_document_413_and_capacity_documents_retry_after(schema):
    for method, path, op in _operations(schema):
        assert ("413" in op["responses"]) == ("requestBody" in op), f"{method} {path}"
        for status in ("429", "503"):
            if status in op["responses"] and path != "/ready":
                assert "Retry-After" in op["responses"][status]["headers"], f"{method} {path} {status}"


def test_system_routes_media_types(schema):
    paths = schema["paths"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert paths["/health"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/Health"}
    ready = paths["/ready"]["get"]["responses"]
    assert ready["200"]["content"] == ready["503"]["content"] == \
        {"application/json": {"schema": {"$ref": "#/components/schemas/Ready"}}}


def _form(schema, path):
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]["$ref"]
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


@pytest.mark.parametrize("path, files, required", [
    ("/v1/images/edits", ("image", "mask"), {"image", "prompt"}),
    ("/v1/audio/transcriptions", ("file",), {"file"}),
    ("/v1/audio/translations", ("file",), {"file"}),
    ("/v1/files", ("file",), {"file", "purpose"}),
    ("/v1/videos", ("input_reference",), {"prompt"}),
])
def test_multipart_bodies_are_described(schema, path, files, required):
    form = _form(schema, path)
    assert set(form["required"]) == required
    for name in files:
        spelled = form["properties"][name]
        variants = spelled.get("anyOf", [spelled])
        assert any(v.get("type") == "string" and v.get("format") == "binary" for v in variants), \
            f"{path} {name}: {spelled}"


def test_hand_read_json_bodies_come_from_the_route_models(schema):
    """The routes that parse request.json() themselves publish their pydantic models' fields."""
    components = schema["components"]["schemas"]
    content = schema["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/VideoBody"}
    assert set(components["VideoBody"]["properties"]) == set(VideoBody.model_fields)
    edit = schema["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    edit_fields = set(components[edit["$ref"].rsplit("/", 1)[1]]["properties"])
    assert edit_fields == set(ImageEditRequest.model_fields) | {"images", "mask"}
    assert set(_form(schema, "/v1/images/edits")["properties"]) == \
        set(ImageEditRequest.model_fields) | {"image", "mask"}


def test_streaming_requests_document_event_streams(schema):
    """Every JSON body with a `stream` field may be answered as server-sent events."""
    components = schema["components"]["schemas"]
    streaming = 0
    for method, path, op in _operations(schema):
        for media_type, body in op.get("requestBody", {}).get("content", {}).items():
            name = body["schema"]["$ref"].rsplit("/", 1)[1]
            if "stream" in components[name]["properties"]:
                streaming += 1
                assert "text/event-stream" in op["responses"]["200"]["content"], f"{method} {path} ({media_type})"
    assert streaming >= 5  # chat, completions, images (generations, edits JSON and form), transcriptions


def test_any_typed_request_fields_are_spelled_out(schema):
    """Fields a model takes as Any (checked by hand) are published as what the route accepts."""
    components = schema["components"]["schemas"]
    messages = components["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["items"] == {"$ref": "#/components/schemas/ChatMessage"} and messages["minItems"] == 1
    for component, field in (("CompletionRequest", "prompt"), ("EmbeddingsBody", "input")):
        assert {"type": "string"} in components[component]["properties"][field]["anyOf"], (component, field)


def test_binary_replies_name_their_media_types(schema):
    paths = schema["paths"]
    speech = paths["/v1/audio/speech"]["post"]["responses"]["200"]["content"]
    assert {"audio/mpeg", "audio/wav", "audio/flac", "audio/ogg", "audio/aac", "audio/pcm",
            "text/event-stream"} == set(speech)
    assert set(paths["/v1/videos/{video_id}/content"]["get"]["responses"]["200"]["content"]) == \
        {"video/mp4", "image/jpeg"}
    assert set(paths["/v1/files/images/{name}"]["get"]["responses"]["200"]["content"]) == \
        {"image/png", "image/jpeg", "image/webp"}


# -- real replies of an in-process app against the schema ------------------------------------------------


def _path_of(template: str) -> str:
    return template.replace("{", "").replace("}", "")  # {video_id} -> video_id: an id that does not exist


def test_every_key_route_answers_401_as_documented(app, schema):
    """Without a key each key-protected operation answers 401, and the reply passes the schema checks."""
    schema_obj = schemathesis.openapi.from_dict(schema)
    client = TestClient(app, raise_server_exceptions=False)
    checked = 0
    for method, template, _ in schema_routes(app):
        if (method, template) in UNAUTHENTICATED:
            continue
        response = client.request(method, _path_of(template), json={} if method == "POST" else None)
        assert response.status_code == 401, (method, template, response.text)
        assert response.json()["error"]["code"] == "missing_api_key"
        validate(schema_obj, method, template, response)
        checked += 1
    assert checked == len(OPERATIONS) - len(UNAUTHENTICATED)


def test_system_and_lookup_replies_pass_the_schema_checks(app, schema):
    schema_obj = schemathesis.openapi.from_dict(schema)
    client = TestClient(app, raise_server_exceptions=False)
    auth = {"Authorization": "Bearer sk-test"}
    cases = [("GET", "/health", "/health", 200), ("GET", "/ready", "/ready", 503),  # the stand-in is not ready
             ("GET", "/metrics", "/metrics", 200),
             ("GET", "/v1/videos/{video_id}", "/v1/videos/nope", 404),
             ("GET", "/v1/files/{file_id}", "/v1/files/nope", 404),
             ("GET", "/v1/batches/{batch_id}", "/v1/batches/nope", 404),
             ("GET", "/v1/files/images/{name}", "/v1/files/images/nope", 404),
             ("GET", "/v1/videos", "/v1/videos?limit=0", 400),
             ("GET", "/v1/files", "/v1/files", 200),
             ("GET", "/v1/models", "/v1/models", 200),
             ("POST", "/v1/batches", "/v1/batches", 400)]
    for method, template, url, status in cases:
        response = client.request(method, url, headers=auth, json={} if method == "POST" else None)
        assert response.status_code == status, (url, response.text)
        validate(schema_obj, method, template, response)


def test_image_links_answer_as_documented(app, schema):
    """With keys on: an unsigned link is a 403, the owner's key opens it (image/png)."""
    schema_obj = schemathesis.openapi.from_dict(schema)
    client = TestClient(app, raise_server_exceptions=False)
    name = app.state.image_store.put(b"\x89PNG\r\n\x1a\n", "png", "alice")
    unsigned = client.get(f"/v1/files/images/{name}")
    assert unsigned.status_code == 403, unsigned.text
    validate(schema_obj, "GET", "/v1/files/images/{name}", unsigned)
    owner = client.get(f"/v1/files/images/{name}", headers={"Authorization": "Bearer sk-test"})
    assert owner.status_code == 200 and owner.headers["content-type"] == "image/png"
    validate(schema_obj, "GET", "/v1/files/images/{name}", owner)


def test_the_checks_catch_an_untrue_reply(schema):
    """The validation above is not vacuous: a reply the schema does not describe fails it."""
    import datetime

    import httpx

    schema_obj = schemathesis.openapi.from_dict(schema)

    def reply(path: str, status: int, body: dict):
        response = httpx.Response(status, json=body, request=httpx.Request("GET", f"http://testserver{path}"))
        response.elapsed = datetime.timedelta(0)  # set by a transport once read; these never went through one
        return response

    for template, response, failure in [
            ("/metrics", reply("/metrics", 200, {"metrics": 1}), "ST105 Undocumented Content-Type"),
            ("/v1/videos/{video_id}", reply("/v1/videos/x", 422, {"detail": []}), "ST103 Undocumented status code"),
            ("/health", reply("/health", 200, {"status": "fine"}), "ST108 Response violates schema")]:
        with pytest.raises(FailureGroup) as caught:
            validate(schema_obj, "GET", template, response)
        assert failure in str(caught.value), (template, str(caught.value))


def test_build_refuses_a_stale_field_override(app, monkeypatch):
    from serve import openapi

    monkeypatch.setitem(openapi.FIELD_TYPES, ("ChatCompletionRequest", "no_such_field"), str)
    with pytest.raises(ValueError, match="ChatCompletionRequest.no_such_field"):
        build_schema(app)
