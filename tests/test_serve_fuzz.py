"""Schemathesis drives a real `lmforge serve` on loopback from its own OpenAPI document.

Every request it generates, valid or not (positive and negative modes), must get a 2xx or a 4xx
with OpenAI's error body: never a 5xx, never a hang (each request has a timeout), never an error
inside a 200 stream, and the server still answers /health at the end.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from .serve_helpers import Server, random_checkpoint

EXAMPLES = {"POST": 30, "GET": 5}  # per operation and mode: bounded so the test takes seconds, in CI
TIMEOUT = 30  # seconds for one request: far above the slowest valid one (16 choices x 64 tokens)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(random_checkpoint(tmp_path_factory.mktemp("fuzz")), "--max-batch-size", "8")
    yield s
    s.stop()


def check_reply(case, response) -> None:
    """The contract: 2xx, or a 4xx with {"error": {message, type, param, code}}."""
    what = f"{case.method} {case.path} {json.dumps(case.body, default=repr)[:300]}"
    assert response.status_code < 500, f"{what} -> {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], what
    elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):  # a list per header
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", what
        assert not any("error" in json.loads(e) for e in events[:-1]), f"{what} -> {response.text[-300:]}"


def test_generated_requests_never_get_a_5xx_or_hang(server):
    schema = schemathesis.openapi.from_url(server.base + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations if op.method.upper() == "POST"} == {"/v1/completions",
                                                                             "/v1/chat/completions"}
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and op.method.upper() == "GET":
                continue  # no body, and any string is a valid model name: nothing to break

            @settings(max_examples=EXAMPLES[op.method.upper()], deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                check_reply(case, case.call(base_url=server.base, timeout=TIMEOUT))

            run()
    assert httpx.get(server.base + "/health").status_code == 200
    assert server.proc.poll() is None
