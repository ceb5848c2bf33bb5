"""Scale-out on Ray Serve: each replica runs the same Service as `lantern serve` (one warm engine worker, the same
ASGI app: /v1/images/generations, /health, /ready, /metrics); Ray Serve routes requests across replicas and
autoscales them on ongoing requests.

    serve run lantern.serve.ray_deployment:build model=/path/to/bundle backend=cuda batch=16
    serve run docs/serving-ray.yaml              # replicas, GPUs and autoscaling in a config file

Needs the `ray` extra (`pip install 'lantern-decoding[ray]'`). A replica reports itself started only once its
engine is warm, and `check_health` fails when its engine worker has failed or died, so Ray replaces it.
"""
from __future__ import annotations

import asyncio
from dataclasses import fields, replace

from ray import serve

from lantern.serve.app import build_app
from lantern.serve.config import ServeConfig
from lantern.serve.service import Service

# What a replica asks for unless the config file says otherwise: one CPU, no GPU (ray_actor_options num_gpus: 1
# gives each replica a GPU; Ray sets CUDA_VISIBLE_DEVICES for it). Autoscaling keeps about one full batch of
# requests in flight per replica; max_ongoing_requests bounds what a replica holds (its slots and queue).
DEFAULT_OPTIONS = dict(
    ray_actor_options={"num_cpus": 1, "num_gpus": 0},
    autoscaling_config={"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16},
    max_ongoing_requests=80,
    health_check_period_s=10,
    health_check_timeout_s=30,
)

# What Serve's controller is started with (`serve.start(controller_options=...)`; `controller_options:` in a config
# file, as docs/serving-ray.yaml). Ray Serve kills a proxy actor that is not ready within 5 s of its creation
# (RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S, read by the controller) while serve.start waits up to 60 s on that same
# first proxy: on a busy node, where a new worker process takes longer than 5 s to start, the proxy is "killed by
# ray.kill ... never ran" and serve.start raises ActorDiedError (ray-project/ray#39739). Given as long as serve.start
# itself waits, a slow proxy is waited for instead.
CONTROLLER_OPTIONS = {"runtime_env": {"env_vars": {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}}}


@serve.deployment(**DEFAULT_OPTIONS)
@serve.ingress()
class LanternDeployment:
    async def __init__(self, config: ServeConfig):
        if config.threads is None:  # the replica's CPUs (ray_actor_options num_cpus), not the whole machine's cores
            import ray  # the ray extra
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
            if cpus:
                config = replace(config, threads=max(1, int(cpus)))
        self.service = Service(config)
        self.service.start()
        await asyncio.to_thread(self.service.worker.ready.wait)  # started = warm: Ray routes only then
        if self.service.worker.failure is not None:
            raise RuntimeError(f"lantern replica warm-up failed: {self.service.worker.failure}")

    def __serve_build_asgi_app__(self):
        return build_app(self.service)

    def check_health(self) -> None:
        """Ray calls this periodically; raising marks the replica unhealthy and Ray replaces it."""
        worker = self.service.worker
        if worker.failure is not None:
            raise RuntimeError(f"engine warm-up failed: {worker.failure}")
        if not worker.alive:
            raise RuntimeError("the engine worker thread has stopped")


INTEGERS = {"threads": "an integer", "widths": "comma-separated integers"}


def config_from_args(args: dict) -> ServeConfig:
    """A `serve run` / config-file `args` mapping (strings from the command line, typed values from YAML) -> a
    ServeConfig; an unknown key is refused, naming the allowed ones."""
    known = {f.name: f for f in fields(ServeConfig) if f.name != "backend_options"}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; allowed: {', '.join(known)}")
    typed = {}
    for name, value in args.items():
        default = getattr(ServeConfig(), name)
        if isinstance(value, str) and name == "methods":
            value = tuple(m.strip() for m in value.split(",") if m.strip())
        elif isinstance(value, str) and name in INTEGERS:  # optional integers: their default None says no type
            try:
                value = tuple(int(v) for v in value.split(",")) if name == "widths" else int(value)
            except ValueError:
                raise ValueError(f"argument {name}={value!r} is not allowed; allowed: {INTEGERS[name]}") from None
        elif isinstance(value, str) and isinstance(default, bool):
            value = value.lower() in ("1", "true", "yes")
        elif isinstance(value, str) and isinstance(default, (int, float)):
            try:
                value = type(default)(value)
            except ValueError:
                raise ValueError(f"argument {name}={value!r} is not allowed; allowed: "
                                 f"{'an integer' if isinstance(default, int) else 'a number'}") from None
        elif isinstance(value, list):
            value = tuple(value)
        typed[name] = value
    config = ServeConfig(**typed)
    config.check()
    return config


def build(args: dict) -> serve.Application:
    """The application builder `serve run` and config files name (import_path
    lantern.serve.ray_deployment:build): args are ServeConfig's fields."""
    return LanternDeployment.bind(config_from_args(args))
