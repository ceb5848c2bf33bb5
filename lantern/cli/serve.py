"""`lantern serve`: flags, the check for the `serve` extra, and uvicorn with a graceful SIGTERM (stop taking
requests, finish those in flight, exit 0)."""
from __future__ import annotations

import asyncio
import importlib
import logging
import os
import socket
import sys
import threading

from lantern.backends import get_backend
from lantern.cli.options import add_backend_options, backend_options
from lantern.cli.parsing import number
from lantern.decoding.config import METHODS
from lantern.exit_codes import EXIT_INTERNAL, EXIT_OK
from lantern.serve.config import ServeConfig
from lantern.serve.families import check_model
from lantern.serve.logs import log_json_to_stderr

SERVE_EXTRA_MODULES = ("starlette", "uvicorn", "prometheus_client")


def missing_extra() -> list[str]:
    """The `serve` extra's modules that cannot be imported."""
    missing = []
    for module in SERVE_EXTRA_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    return missing


def add_arguments(s) -> None:
    d = ServeConfig()
    s.add_argument("--model", help="bundle folder, or a Janus / Chameleon (Anole) transformers folder "
                                   "(default: the embedded model)")
    s.add_argument("--method", choices=("auto", *METHODS), default=d.method,
                   help="what a request runs unless it names a method (auto: AR at once, then the plan chosen in "
                        "the background for a full batch, switched to between steps)")
    s.add_argument("--methods", help="comma-separated methods requests may name besides auto (default: every "
                                     "method the model can run); each gets its own engine on first use")
    s.add_argument("--allow-relaxed", action="store_true", help="auto may choose relaxed plans (bundles: none is "
                                                                "validated for a family folder)")
    s.add_argument("--batch", type=number(int, 1), default=d.batch,
                   help=f"the widest engine's slots: images decoded together (default {d.batch})")
    s.add_argument("--widths", help="comma-separated static widths prepared per engine, up to --batch (always "
                                    "included); new requests take the narrowest that fits the load (default: 1, 4, "
                                    "16, ... below --batch)")
    s.add_argument("--width-hold", type=number(float, 0), default=d.width_hold_s,
                   help=f"seconds a width's load still places new requests after it fell, so clients coming back "
                        f"for their next image stay on the width they left (default {d.width_hold_s:g}; 0: the load "
                        f"of the moment only)")
    s.add_argument("--threads", type=number(int, 1), help="intra-op threads of the steps (torch CPU modes, ONNX "
                                                          "Runtime; default: the physical cores)")
    s.add_argument("--plan-images", type=number(int, 1), default=d.plan_images,
                   help=f"--method auto: the images its one-time costs (calibration, compiles) are weighed against "
                        f"(default {d.plan_images})")
    s.add_argument("--t5", help="text-to-image bundles: the local T5 encoder folder (default: $LANTERN_T5); never "
                                "downloaded")
    s.add_argument("--vq", help="Chameleon folders: the VQGAN folder (vqgan.yaml, vqgan.ckpt; default: found "
                                "beside the model)")
    s.add_argument("--max-prompt-tokens", type=number(int, 1), default=d.max_prompt_tokens,
                   help=f"Janus / Chameleon folders: the longest prompt in tokens, the model's own around it "
                        f"included; longer ones get 422 (default {d.max_prompt_tokens}; every prompt is padded to it)")
    s.add_argument("--queue", type=number(int, 0), default=d.queue,
                   help=f"images that may wait for a slot; beyond that, 429 (default {d.queue})")
    s.add_argument("--timeout", type=number(float, 0, low_open=True), default=d.timeout_s,
                   help=f"a request's deadline in seconds unless it asks for less (default {d.timeout_s:g})")
    s.add_argument("--max-timeout", type=number(float, 0, low_open=True), default=d.max_timeout_s,
                   help=f"the most a request's timeout may ask for (default {d.max_timeout_s:g})")
    s.add_argument("--max-n", type=number(int, 1), default=d.max_n, help=f"images per request (default {d.max_n})")
    s.add_argument("--max-engines", type=number(int, 1), default=d.max_engines,
                   help=f"engines kept at once, one per (method, sampling overrides) requested (default "
                        f"{d.max_engines})")
    s.add_argument("--served-model-name", help="the `model` a request may name (default: the model folder's name)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=number(int, 0, 65535), default=8000, help="port (default 8000; 0: any free)")
    add_backend_options(s)
    s.set_defaults(func=cmd_serve)


def config_from_args(args):
    methods = None if args.methods is None else tuple(m.strip() for m in args.methods.split(",") if m.strip())
    return ServeConfig(model=args.model, backend=args.backend, dtype=args.dtype, method=args.method,
                       methods=methods, allow_relaxed=args.allow_relaxed, batch=args.batch,
                       widths=None if args.widths is None else parse_widths(args.widths), threads=args.threads,
                       width_hold_s=args.width_hold,
                       plan_images=args.plan_images, t5=args.t5, vq=args.vq,
                       max_prompt_tokens=args.max_prompt_tokens, queue=args.queue,
                       timeout_s=args.timeout, max_timeout_s=args.max_timeout, max_n=args.max_n,
                       max_engines=args.max_engines, served_name=args.served_model_name,
                       backend_options=backend_options(args))


def parse_widths(text: str) -> tuple[int, ...]:
    """--widths "1,4,16" -> (1, 4, 16); ValueError naming a bad item."""
    out = []
    for item in text.split(","):
        try:
            out.append(int(item.strip()))
        except ValueError:
            raise ValueError(f"--widths: {item.strip()!r} is not an integer; allowed: comma-separated integers "
                             f"in 1..--batch") from None
    return tuple(out)


def cmd_serve(args) -> int:
    missing = missing_extra()
    if missing:
        raise ValueError(f"lantern serve needs the 'serve' extra (missing: {', '.join(missing)}); install it with "
                         f"pip install 'lantern-decoding[serve]'")
    import uvicorn  # the serve extra, checked above

    from lantern.serve.app import build_app  # the serve extra (starlette, prometheus_client)
    from lantern.serve.service import Service  # the serve extra (prometheus_client)
    config = config_from_args(args)
    config.check()
    get_backend(config.backend, **config.backend_options)  # an unknown or unavailable backend fails before loading
    check_model(config)  # a t2i bundle's T5 folder, a family folder's files, before binding or loading
    try:  # the port is taken before any loading, so a busy port fails fast
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    try:
        service = Service(config)
    except BaseException:
        sock.close()
        raise
    log = logging.getLogger("lantern.serve")
    log_json_to_stderr(log)

    stopped_by: list[int] = []  # the signal that cut the drain short

    class Server(uvicorn.Server):
        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def close_connections(self) -> None:
            """Close every connection still open: a request still receiving its body ends as its client's
            disconnect (499), so the shutdown goes on, service stop included, with nothing left mid-request."""
            for connection in list(self.server_state.connections):
                connection.transport.close()

        def handle_exit(self, sig, frame):
            """SIGTERM or SIGINT: drain (new requests and /ready get 503, those in flight finish), then exit 0.
            A second signal stops at once: the images in flight are cancelled and their requests answered 503,
            then the engine thread ends and the command exits 128 + the signal's number. A third one leaves
            without waiting for connections to close: it closes them. Not re-raised afterwards, as uvicorn
            would."""
            if self.should_exit and stopped_by:
                self.loop.call_soon_threadsafe(self.close_connections)  # run by the loop, not amid its bytecodes
            elif self.should_exit:
                stopped_by.append(sig)
                service.abandon()
            service.draining = True
            self.should_exit = True

    server = Server(uvicorn.Config(build_app(service), log_level="warning", access_log=False, lifespan="on"))
    failed = threading.Event()

    def stop_if_warmup_fails():
        service.worker.ready.wait()
        if service.worker.failure is not None:
            failed.set()
            server.should_exit = True
        else:
            log.info("ready", extra={"fields": {"event": "ready", **service.describe()}})

    threading.Thread(target=stop_if_warmup_fails, daemon=True).start()
    host, port = sock.getsockname()[:2]
    log.info("listening", extra={"fields": {"event": "listening", "url": f"http://{host}:{port}",
                                            "model": service.info.name, "method": config.method,
                                            "widths": list(config.ladder), "threads": service.threads}})
    server.run(sockets=[sock])
    code = EXIT_INTERNAL if failed.is_set() else 128 + stopped_by[0] if stopped_by else EXIT_OK
    log.info("stopped", extra={"fields": {"event": "stopped", "exit_code": code}})
    if service.planner is not None and service.planner.alive:
        # auto's background calibration is inside a compile or an export, which nothing interrupts: the
        # interpreter's teardown under a thread inside torch aborts the process, so leave without it
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code
