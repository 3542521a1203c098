"""Backend selection shared by every op: one `Dispatch` per op holds its fast backends and picks one per call.

Each fast backend registers an implementation and an `auto` predicate (may `backend="auto"` pick it for this
call?), optionally an `accepts` predicate (may a caller who names it run this call?; without one a named backend
always runs and its implementation raises its own errors). `auto` resolves to the first registered backend, in
registration order, whose `auto` predicate accepts the call; the reference is last and always supported. An op whose
fastest backend depends on the call passes `rank`: it orders the candidates per call (from measurements) and says
why, and `auto` takes the first of that order whose predicate holds. The choice is logged once per (op, backend,
reason), so a run's log says which implementation actually ran and why; inside a region torch.compile traces it
is not logged (the same choice is made, and logged, where the op runs eagerly). A backend is opaque to
torch.compile (a graph break; it runs eagerly between the compiled pieces) unless it registers as `traceable`: the
owner of a kernel states that Dynamo can trace it (a `torch.library` custom op with a fake implementation, or an
autograd.Function Dynamo traces). A backend may also register its forward and backward as separate functions
(`phases`): an op that wraps them as a custom op pair holds them inside a compiled graph, and asks this same
dispatch which backend runs (`among` the backends with phases).
Backend names come from `moela.ops.backends`, which imports nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger("moela.ops")


@dataclass(frozen=True)
class FastBackend:
    impl: Callable[..., object]
    auto: Callable[..., bool]
    accepts: Callable[..., bool] | None = None
    traceable: bool = False
    phases: tuple[Callable[..., object], Callable[..., object]] | None = None  # (forward, backward)


class Dispatch:
    """The backends of one op. `names` is the op's tuple from `moela.ops.backends`; `needs` says what a backend that
    is not registered here requires (for the error); `describe(*args, **kwargs)` sums a call up for the error a
    named backend that does not accept it raises; `rank(*args, **kwargs) -> (names, reason)` orders auto's
    candidates for this call (default: registration order)."""

    def __init__(self, op: str, names: tuple[str, ...], *, needs: str = "",
                 describe: Callable[..., str] | None = None,
                 rank: Callable[..., tuple[list[str], str]] | None = None) -> None:
        self.op = op
        self.names = names
        self.needs = needs
        self.describe = describe
        self.rank = rank
        self.fast: dict[str, FastBackend] = {}
        self.logged: set[tuple[str, str]] = set()

    def register(self, name: str, impl: Callable[..., object], *, auto: Callable[..., bool],
                 accepts: Callable[..., bool] | None = None, traceable: bool = False,
                 phases: tuple[Callable[..., object], Callable[..., object]] | None = None) -> None:
        """`traceable`: torch.compile may trace `impl` into its graph (pure torch ops, or kernels wrapped as
        `torch.library` custom ops with fake implementations, or an autograd.Function Dynamo can trace); otherwise
        the call is a graph break and `impl` runs eagerly between the compiled pieces. `phases`: the backend's
        (forward, backward) functions, for an op that runs them as a custom op pair (the module docstring)."""
        if name not in self.names or name in ("auto", "reference"):
            raise ValueError(f"{self.op}: cannot register backend {name!r}; its names are {', '.join(self.names)}")
        if not traceable:
            impl = torch.compiler.disable(impl)
        self.fast[name] = FastBackend(impl, auto, accepts, traceable, phases)

    def check(self, backend: str) -> None:
        if backend not in self.names:
            raise ValueError(f"{self.op}: unknown backend {backend!r}; choose one of {', '.join(self.names)}")

    def choose(self, backend: str, *args, reason: str = "", among: tuple[str, ...] | None = None, **kwargs) -> str:
        """The backend that runs this call: for "auto" the first candidate (registration order, or `rank`'s) whose
        `auto(*args, **kwargs)` holds, else "reference"; a named one if it is registered here and accepts the call.
        `among`: the caller runs only these backends (a form of the op that needs kernels some backends lack); auto
        skips the others, naming each it would have taken in the log, and falls back to "reference" only if
        "reference" is among them."""
        self.check(backend)
        if backend == "auto":
            order = list(self.fast)
            if self.rank is not None:
                order, why = self.rank(*args, **kwargs)
                reason = ", ".join(part for part in (reason, why) if part)
            chosen, skipped = "reference", []
            for name in order:  # the predicates of the candidates after the chosen one are not evaluated
                if name not in self.fast or not self.fast[name].auto(*args, **kwargs):
                    continue
                if among is not None and name not in among:
                    skipped.append(name)
                    continue
                chosen = name
                break
            if skipped:
                reason = ", ".join(part for part in (reason, f"{', '.join(skipped)} cannot run in this form of the "
                                                              f"op (it runs {', '.join(among)})") if part)
            if chosen == "reference" and among is not None and "reference" not in among:
                raise RuntimeError(f"{self.op}: none of {', '.join(among)} can run this call; {reason}")
            self._log(chosen, f"auto, {reason}" if reason else "auto")
            return chosen
        if among is not None and backend not in among:
            raise ValueError(f"{self.op}: backend {backend!r} cannot run in this form of the op (it runs "
                             f"{', '.join(among)})")
        if backend != "reference":
            fast = self.fast.get(backend)
            if fast is None:
                needs = f" (needs {self.needs})" if self.needs else ""
                raise RuntimeError(f"{self.op}: backend {backend!r} is not available here{needs}; use backend='auto' "
                                   f"or 'reference'")
            if fast.accepts is not None and not fast.accepts(*args, **kwargs):
                call = f" ({self.describe(*args, **kwargs)})" if self.describe else ""
                raise ValueError(f"{self.op}: backend {backend!r} does not support this call{call}; use "
                                 f"backend='auto'")
        self._log(backend, f"asked for, {reason}" if reason else "asked for")
        return backend

    def impl(self, name: str) -> Callable[..., object]:
        return self.fast[name].impl

    def with_phases(self) -> tuple[str, ...]:
        """The registered backends with separate forward and backward functions."""
        return tuple(name for name, fast in self.fast.items() if fast.phases is not None)

    def _log(self, backend: str, reason: str) -> None:
        if torch.compiler.is_compiling():  # traced, logging would break the graph and the check guard on the set
            return
        if (backend, reason) not in self.logged:
            self.logged.add((backend, reason))
            log.info("%s: using backend %r (%s)", self.op, backend, reason)
