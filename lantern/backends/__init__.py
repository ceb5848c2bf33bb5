"""Swappable backends behind one small contract (see base.py); `get_backend` picks one by name."""
from lantern.backends.base import (Abilities, Availability, Backend, BackendUnavailable, Capabilities, MemoryReport, Runner,
                                   StaticSpec, StepOutput)
from lantern.backends.registry import ENV_VAR, backend_class, get_backend, registered, resolve_name, valid_names

__all__ = ["Abilities", "Availability", "Backend", "BackendUnavailable", "Capabilities", "MemoryReport", "Runner", "StaticSpec",
           "StepOutput", "ENV_VAR", "backend_class", "get_backend", "registered", "resolve_name", "valid_names"]
