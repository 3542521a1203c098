"""Backend selection shared by every op: validate the requested backend and log the automatic choice once.

`auto` resolves to the first candidate whose `supported(...)` predicate accepts the call; the reference backend
is always last and always supported. The resolution is logged once per (op, backend, reason) so a run's log says
which implementation actually ran.
"""

from __future__ import annotations

import logging

log = logging.getLogger("moela.ops")
_logged: set[tuple[str, str, str]] = set()


def check_backend(op: str, backend: str, known: tuple[str, ...]) -> None:
    if backend not in known:
        raise ValueError(f"{op}: unknown backend {backend!r}; choose one of {', '.join(known)}")


def log_choice(op: str, backend: str, reason: str = "") -> None:
    key = (op, backend, reason)
    if key not in _logged:
        _logged.add(key)
        log.info("%s: using backend %r%s", op, backend, f" ({reason})" if reason else "")


def resolve_backend(op: str, backend: str, registry: dict, *args, reason: str = "", needs: str = "",
                    **kwargs) -> str:
    """The backend that runs this call (`backend` already passed `check_backend`): the named one if registered, or
    for `auto` the first registered one whose `supported(*args, **kwargs)` accepts the call, else "reference".
    `registry` maps name -> (supported, impl); `needs` says what a missing backend requires (for the error)."""
    if backend == "auto":
        chosen = next((name for name, (ok, _) in registry.items() if ok(*args, **kwargs)), "reference")
        log_choice(op, chosen, reason)
        return chosen
    if backend != "reference" and backend not in registry:
        raise RuntimeError(f"{op}: backend {backend!r} is not available here{f' (needs {needs})' if needs else ''}; "
                           f"use backend='auto' or 'reference'")
    return backend
