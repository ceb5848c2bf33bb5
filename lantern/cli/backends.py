"""`lantern backends`: what each registered backend is here (available or why not), or, with --check, the
conformance kit run on one."""
from __future__ import annotations

from lantern.backends import backend_class, registered, resolve_name
from lantern.backends.base import describe
from lantern.backends.conformance import check_backend
from lantern.exit_codes import EXIT_FAILED_CASES, EXIT_OK, EXIT_UNAVAILABLE


def add_arguments(b) -> None:
    b.add_argument("--check", metavar="NAME", help="run the conformance kit (lantern.backends.conformance) on "
                                                   "backend NAME: exit 0 if it conforms, 1 if a check fails, "
                                                   "3 if it is unavailable here")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_backends, show=print_backends)


def cmd_backends(args) -> dict:
    if args.check:
        report = check_backend(args.check).to_dict()
        failed = not report["passed"]
        return {**report, "exit_code": EXIT_FAILED_CASES if failed else EXIT_OK if report["available"]
                else EXIT_UNAVAILABLE}
    rows = []
    for name in sorted(registered()):
        try:
            rows.append(describe(backend_class(name)))
        except Exception as e:  # a broken third-party backend must not hide the others
            rows.append({"name": name, "available": False, "reason": f"failed to load: {e}"})
    # resolving the selection ($LANTERN_BACKEND or auto) fails loudly on a bad name, as every command does
    return {"backends": rows, "selected": resolve_name(None)}


def print_backends(out: dict) -> None:
    if "checks" in out:
        for check in out["checks"]:
            print(f"{check['status'].upper():<5} {check['name']}: {check['message']}")
        verdict = ("unavailable here: nothing else was checked" if not out["available"] and out["passed"]
                   else "conforms" if out["passed"] else "does NOT conform")
        print(f"{out['backend']}: {verdict}")
        return
    for row in out["backends"]:
        if row["available"]:
            print(f"{row['name']:<12} available    device={row['device']} dtypes={','.join(row['dtypes'])} "
                  f"preparation={row['preparation']}" + (" fused-step" if row["fused_step"] else ""))
        else:
            print(f"{row['name']:<12} unavailable: {row['reason']}")
    print(f"selected ($LANTERN_BACKEND or auto): {out['selected']}")
