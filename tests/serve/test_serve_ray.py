"""The Ray Serve deployment: one replica on a local Ray instance bound to loopback answers generation requests over
HTTP with the same images as the service alone, and reports healthy."""
import socket
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from lantern.serve.ray_deployment import CONTROLLER_OPTIONS, build, config_from_args  # noqa: E402
from tiny_bundle import write_tiny_bundle  # noqa: E402

WAIT_S = 300  # a bound for a wait that hangs, not a speed: every wait below ends on readiness


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=WAIT_S).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url}/ready did not answer 200 within {WAIT_S} s")


@pytest.mark.slow
def test_one_replica_on_local_ray_answers_requests(tmp_path):
    bundle = write_tiny_bundle(tmp_path / "tiny")
    port = free_port()
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=CONTROLLER_OPTIONS)
        app = build({"model": str(bundle), "method": "ar", "batch": "2", "queue": "4", "max_n": "2"})
        serve.run(app, name="lantern", route_prefix="/", blocking=False)  # returns once the replica is warm
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)  # the proxy may lag the replica
        body = {"class_id": 1, "seed": 4, "n": 2, "return_tokens": True}
        answers = [httpx.post(f"{url}/v1/images/generations", json=body, timeout=WAIT_S) for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200]
        images = [[(d["b64_json"], d["tokens"]) for d in a.json()["data"]] for a in answers]
        assert images[0] == images[1]  # same request, same seed, same images
        assert len(answers[0].json()["data"][0]["tokens"]) == 16
        bad = httpx.post(f"{url}/v1/images/generations", json={"class_id": 9}, timeout=WAIT_S)
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "class_id"
        assert "lantern:requests_total" in httpx.get(f"{url}/metrics", timeout=WAIT_S).text
        ready = httpx.get(f"{url}/ready", timeout=WAIT_S).json()
        assert ready["threads"] == 1 and ready["widths"] == [1, 2]  # the replica's one CPU; the ladder up to batch
        status = serve.status().applications["lantern"]
        assert status.status == "RUNNING"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.parametrize("args, message", [
    ({"batch": "x"}, "argument batch='x' is not allowed; allowed: an integer"),
    ({"colour": "red"}, "unknown argument(s) colour; allowed: model, backend"),
    ({"batch": "0"}, "batch 0 is not allowed; allowed: an integer >= 1"),
    ({"threads": "two"}, "argument threads='two' is not allowed; allowed: an integer"),
    ({"batch": "4", "widths": "1,8"}, "widths: 8 is not allowed; allowed: integers in 1..4"),
])
def test_bad_deployment_args_are_refused_naming_them(args, message):
    with pytest.raises(ValueError) as e:
        config_from_args(args)
    assert message in str(e.value)


def test_args_from_the_command_line_are_typed():
    config = config_from_args({"batch": "8", "methods": "ar,eagle2", "allow_relaxed": "true", "timeout_s": "5"})
    assert config.batch == 8 and config.methods == ("ar", "eagle2") and config.allow_relaxed and config.timeout_s == 5.0
    config = config_from_args({"batch": "16", "widths": "2,8", "threads": "3", "t5": "/models/t5"})
    assert config.ladder == (2, 8, 16) and config.threads == 3 and config.t5 == "/models/t5"


def test_documented_config_file_is_valid_for_ray_serve():
    """docs/serving-ray.yaml passes Ray Serve's own schema, and its args make a ServeConfig."""
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema
    doc = yaml.safe_load((Path(__file__).parents[2] / "docs" / "serving-ray.yaml").read_text())
    schema = ServeDeploySchema.model_validate(doc)
    assert schema.controller_options.model_dump() == CONTROLLER_OPTIONS  # a busy node's proxy is waited for
    app = schema.applications[0]
    assert app.import_path == "lantern.serve.ray_deployment:build"
    config = config_from_args(app.args)
    assert config.backend == "cuda" and config.batch == 16
    assert app.deployments[0].ray_actor_options.num_gpus == 1
