"""The ASGI app (Starlette): POST /v1/images/generations, GET /health, /ready, /metrics.

Status codes: 200 images; 422 a bad field (the error's `param` names it); 429 queue full (Retry-After); 503 not
ready, draining, or stopped by a second signal (its images cancelled); 504 the request's deadline passed (its
images cancelled); 500 lantern's own bug. A client that disconnects, while sending its body or waiting for its
images, has its images cancelled (logged with status 499, as nginx does, and counted with outcome "cancelled"). A
refused value is repeated in the answer and the log cut to its first characters and its length. One log record per
request on the `lantern.serve` logger, its fields in `extra={"fields": ...}` (lantern.serve.logs writes them as one
JSON line).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lantern.serve.schema import RequestError, parse_request
from lantern.serve.service import ClientGone, DeadlineExceeded, QueueFull, Service, Unavailable
from lantern.serve.worker import Cancelled, EngineFailed, EnginesBusy, ShutDown

log = logging.getLogger("lantern.serve")
LOGGED_PROMPT = 200  # characters of an accepted prompt its request's log line keeps


def error(status: int, message: str, kind: str, param=None, headers=None) -> JSONResponse:
    """OpenAI's error shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status,
                        headers=headers)


async def wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (after the body was read, the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_json(request: Request) -> object:
    """The request's body as JSON, or RequestError naming the body: not UTF-8 JSON, or nested deeper than the
    JSON reader goes (RecursionError)."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:  # (json.JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise RequestError("body", f"the body is not valid JSON ({e}); allowed: a JSON object") from None
    except RecursionError:
        raise RequestError("body", "the body's JSON is nested too deeply to read; allowed: a JSON object of the "
                                   "request's fields") from None


def clipped(text: str, limit: int = LOGGED_PROMPT) -> str:
    """A prompt for the log line: its first `limit` characters and its length (one line stays one line)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def build_app(service: Service) -> Starlette:
    """The app's lifespan starts the service's engine worker (unless its host started it already) and stops it at
    shutdown, after the requests in flight."""

    async def answer(request: Request, entry: dict) -> tuple[str, Response]:
        """(outcome, response) of one generation request; `entry` gathers its log fields."""
        try:
            req = parse_request(await read_json(request), service.info, service.config.timeout_s)
            entry.update({"n": req.n, "seed": req.seed, "method": req.method,
                          **({"prompt": clipped(req.condition)} if isinstance(req.condition, str)
                             else {"class_id": req.condition})})
            out = await service.generate(req, lambda: wait_disconnect(request))
        except RequestError as e:
            return "bad_request", error(422, str(e), "invalid_request_error", e.field)
        except ValueError as e:  # the engine refused a request the schema let through
            return "bad_request", error(422, str(e), "invalid_request_error")
        except QueueFull as e:
            return "rejected", error(429, str(e), "rate_limit_error", headers={"Retry-After": str(e.retry_after_s)})
        except EnginesBusy as e:
            return "rejected", error(429, f"{e}; retry later", "rate_limit_error",
                                     headers={"Retry-After": str(service.retry_after_s())})
        except Unavailable as e:
            return "unavailable", error(503, f"not taking requests: {e}", "unavailable")
        except ShutDown as e:
            return "unavailable", error(503, str(e), "unavailable")
        except DeadlineExceeded as e:
            return "timeout", error(504, str(e), "timeout")
        except (ClientGone, Cancelled, ClientDisconnect):  # (ClientDisconnect: gone while sending its body)
            return "cancelled", error(499, "the client disconnected", "cancelled")
        except EngineFailed as e:
            return "error", error(500, f"internal error: {e}", "server_error")
        except Exception as e:  # noqa: BLE001  our bug: answered and logged with its trace
            log.error("internal error", exc_info=True)
            return "error", error(500, f"internal error: {e}", "server_error")
        stats = [d["stats"] for d in out["data"]]
        entry.update(id=out["id"], queue_wait_s=max(s["queue_wait_s"] for s in stats),
                     decode_s=max(s["decode_s"] for s in stats), steps=[s["steps"] for s in stats])
        return "ok", JSONResponse(out)

    async def generations(request: Request) -> Response:
        t0 = time.perf_counter()
        entry = {"event": "request", "path": request.url.path,
                 "client": request.client.host if request.client else None}
        outcome, status = "cancelled", 499  # unless answered: the host cancelled the handler (client gone)
        service.metrics.in_flight.inc()
        try:
            outcome, response = await answer(request, entry)
            status = response.status_code
            if status != 200:
                entry["error"] = json.loads(response.body)["error"]["message"]
            return response
        finally:
            service.metrics.in_flight.dec()
            seconds = time.perf_counter() - t0
            service.metrics.observe_request(outcome, seconds, entry.get("n", 0))
            log.info("request", extra={"fields": {**entry, "status": status, "outcome": outcome,
                                                  "total_s": round(seconds, 6)}})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        return JSONResponse({"status": service.status(), **service.describe()}, 200 if service.ready else 503)

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        await asyncio.to_thread(service.stop)

    return Starlette(routes=[Route("/v1/images/generations", generations, methods=["POST"]),
                             Route("/health", health), Route("/ready", ready), Route("/metrics", metrics)],
                     lifespan=lifespan)
