"""Where a first step's seconds go: the compilers it runs, each timed where it is called.

torch.compile's own accounting (`measure.compile_seconds`) covers Dynamo, AOTAutograd and Inductor; its phases come
from `torch._dynamo.utils.compilation_time_metrics` (seconds per timed function, nested: a phase includes the
phases it calls). Outside it, a first step also compiles, at each kernel's first call:
- Triton's JIT in this process (`triton.compiler.compile`): moela's own kernels (Inductor compiles its kernels in
  worker processes, which its phases cover);
- Triton's autotuner benchmarking its configurations (`Autotuner._bench`, including the compiles it triggers, which
  the JIT line counts too);
- flash-attn-4: importing it (the CuTe DSL) and compiling its kernels (`cutlass.cute.compile`);
- Inductor's kernels at their first launch: loading the compiled variants (`CachingAutotuner.precompile`) and
  benchmarking them to pick one (`autotune_to_one_config`), which a warm start reads from its cache.
`CompilerClock.install()` wraps these entry points for the rest of the process (a benchmark row's own process);
`report()` returns seconds and calls per entry, and the top torch.compile phases.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from contextlib import contextmanager


class CompilerClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def timing(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def _wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            with self.timing(name):
                return fn(*args, **kwargs)

        timed.__wrapped__ = fn
        return timed

    def _wrap_method(self, name: str, method):
        def timed(obj, *args, **kwargs):
            with self.timing(name):
                return method(obj, *args, **kwargs)

        timed.__wrapped__ = method
        return timed

    def install(self) -> None:
        """Wrap the compilers' entry points (those that are importable here)."""
        try:
            import triton.compiler
            from triton.runtime.autotuner import Autotuner
        except ImportError:
            pass
        else:
            triton.compiler.compile = self._wrap("triton JIT compile", triton.compiler.compile)
            Autotuner._bench = self._wrap_method("triton autotune", Autotuner._bench)
        try:
            from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        except ImportError:
            pass
        else:
            for method, name in (("precompile", "Inductor first-launch precompile"),
                                 ("autotune_to_one_config", "Inductor first-launch tuning")):
                if hasattr(CachingAutotuner, method):
                    setattr(CachingAutotuner, method, self._wrap_method(name, getattr(CachingAutotuner, method)))
        from moela.ops.attention import flash

        load = flash._flash_module

        def timed_load():
            first = "flash_attn.cute" not in sys.modules
            with self.timing("flash-attn-4 import") if first else _nothing():
                result = load()
            cute = sys.modules.get("cutlass.cute")
            if cute is not None and not hasattr(cute.compile, "__wrapped__"):
                cute.compile = self._wrap("flash-attn-4 CuTe compile", cute.compile)
            return result

        flash._flash_module = timed_load

    def report(self, top: int = 8) -> dict:
        """{entry: [seconds, calls]} for the wrapped compilers, and "torch.compile phases": the `top` timed
        functions of torch.compile by total seconds."""
        out = {name: [round(s, 2), self.calls[name]] for name, s in sorted(self.seconds.items())}
        from torch._dynamo.utils import compilation_time_metrics

        phases = sorted(((name, sum(times), len(times)) for name, times in compilation_time_metrics.items()),
                        key=lambda item: -item[1])
        out["torch.compile phases"] = {name: [round(s, 2), n] for name, s, n in phases[:top]}
        return out


@contextmanager
def _nothing():
    yield
