"""`lantern` command line: generate, eval, backends, profile, train, info, export-onnx, import, serve.

Exit codes (lantern.exit_codes): 0 ok, 1 internal error (or a failed case or check), 2 bad usage or input,
3 backend unavailable, 130 stopped by Ctrl-C, 143 stopped by SIGTERM (docs/reliability.md).

With --json, a command prints exactly one JSON object on stdout (errors too: {"error": ..., "exit_code": ...}).

Each command is a module of this package, named in COMMANDS and imported only when that command runs, so
`lantern --help` loads no model code. A command module's `add_arguments(parser)` adds its flags and sets `func`
(returns a result dict, or an exit code once it printed its own output) and `show` (prints the result dict);
options shared by several commands are in lantern.cli.options.
"""
from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import traceback
from typing import NoReturn

from lantern.cli.parsing import Parser, expected_failure
from lantern.cli.signals import (Stopped, answer_until_exit, answering_signals, exit_with, raise_if_stopped,
                                 writing_answer)
from lantern.exit_codes import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK, EXIT_UNAVAILABLE

# command -> (its module, its line in `lantern --help`), in the order `lantern --help` lists them
COMMANDS = {
    "generate": ("lantern.cli.generate", "generate images (default model: the embedded bundle)"),
    "eval": ("lantern.cli.evaluate", "class accuracy and Frechet distance of generated images"),
    "backends": ("lantern.cli.backends", "list backends: available or why not, device, dtypes"),
    "profile": ("lantern.cli.profile", "cross-hardware profile suite: run, compare, calibrate"),
    "train": ("lantern.cli.train", "train one stage of a bundle (tokenizer, target, drafter, evaluator)"),
    "info": ("lantern.cli.info", "what a bundle or model-family folder is, and what runs on it"),
    "export-onnx": ("lantern.cli.export_onnx", "export the ONNX graphs of a generation setup into a folder"),
    "import": ("lantern.cli.import_checkpoints", "make a bundle from LlamaGen checkpoints (docs/models.md)"),
    "serve": ("lantern.cli.serve", "an HTTP service: POST /v1/images/generations, /health, /ready, /metrics "
                                   "(needs the serve extra)"),
}


def build_parser(commands=None) -> argparse.ArgumentParser:
    """The parser with every command's flags, or only those of `commands` (names; the others are listed with
    their help line and nothing else, so their modules are not imported)."""
    parser = Parser(prog="lantern", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_line) in COMMANDS.items():
        p = sub.add_parser(name, help=help_line)
        if commands is None or name in commands:
            importlib.import_module(module).add_arguments(p)  # the lazy subcommand table: loaded when it runs
    return parser


def main(argv=None) -> int:
    """`lantern ARGV` in this process: the command's exit code, once its answer is written (its output, or the
    error's line and, with --json, its JSON object). SIGINT and SIGTERM are answered meanwhile as
    lantern.cli.signals says, and the handlers found are put back."""
    argv = sys.argv[1:] if argv is None else argv
    with answering_signals():
        return _command(argv)


def run() -> NoReturn:
    """The `lantern` process (its console script, `python -m lantern`, `python -m lantern.cli`): main() with
    SIGINT and SIGTERM answered until the process ends (lantern.cli.signals)."""
    answer_until_exit()
    try:
        code = main()
    except Stopped as e:  # a signal before main's own answering began
        code = _fail(str(e), e.code, "--json" in sys.argv[1:])
    except SystemExit as e:  # argparse's --help ends this way
        code = e.code if isinstance(e.code, int) else EXIT_OK if e.code is None else EXIT_INTERNAL
    exit_with(code)


def _command(argv: list[str]) -> int:
    args = None
    try:
        try:
            args = build_parser(argv[:1]).parse_args(argv)  # imports the command's module: torch, for most
            out = args.func(args)
            raise_if_stopped()
        except (ValueError, FileNotFoundError) as e:
            return _fail(str(e), EXIT_BAD_INPUT, _wants_json(args, argv))
        except Exception as e:  # noqa: BLE001  anything else is our bug unless it is the machine's: say which
            if backend_unavailable(e):
                return _fail(str(e), EXIT_UNAVAILABLE, _wants_json(args, argv))
            expected = expected_failure(e, args)
            if expected:
                return _fail(expected, EXIT_BAD_INPUT, _wants_json(args, argv))
            return _fail(f"internal error: {e}", EXIT_INTERNAL, _wants_json(args, argv), trace=True)
        code = out if isinstance(out, int) else out.get("exit_code", EXIT_OK)
        with writing_answer(code):  # (an int: the command printed its own output)
            if isinstance(out, dict) and args.json:
                print(json.dumps(out))
            elif isinstance(out, dict):
                args.show(out)
        return code
    except (Stopped, KeyboardInterrupt) as e:  # while it worked, or before its answer began
        stop = e if isinstance(e, Stopped) else Stopped(signal.SIGINT)  # KeyboardInterrupt: a library's own
        return _fail(str(stop), stop.code, _wants_json(args, argv))


def _wants_json(args, argv: list[str]) -> bool:
    return getattr(args, "json", False) if args is not None else "--json" in argv


def backend_unavailable(e: Exception) -> bool:
    """Whether `e` is lantern.backends.BackendUnavailable: looked up, not imported, as only a command that loaded
    the backends can raise it."""
    base = sys.modules.get("lantern.backends.base")
    return base is not None and isinstance(e, base.BackendUnavailable)


def _fail(message: str, code: int, as_json: bool, trace: bool = False) -> int:
    """Write a failed command's answer: its line on stderr (after the trace of an internal error) and, with
    --json, its JSON object on stdout."""
    with writing_answer(code):
        if trace:
            traceback.print_exc()
        if as_json:
            print(json.dumps({"error": message, "exit_code": code}))
        print(f"lantern: error: {message}", file=sys.stderr)
    return code
