"""Launching an already compiled Triton kernel without Triton's per-launch dispatch.

``kernel[grid](*args, **constexprs)`` runs, on every launch, Triton's ``JITFunction.run``:
the binder over every argument (its type and specialization: a pointer 16-byte aligned or
not, an int equal to 1 or a multiple of 16), the cache key (``str`` of the options), the
compiled kernel's lookup, the check of the globals it read, the launch metadata, then the C
launcher. For a decode call of two to four launches that was 25-35 µs per launch on the
H200 machine's host (session 29), more than the kernels themselves at small shapes.

:class:`DirectLaunch` is one launch site (a kernel and its constexpr keyword arguments).
Its first launch of each specialization goes through Triton (which compiles if needed) and
keeps the compiled kernel under that specialization's fingerprint: the device, each
tensor argument's dtype and whether it starts on a 16-byte boundary, and every int
argument's value (stricter than Triton's own key, never looser). The kinds of the
arguments (tensor, int, other) at each position must not change between a site's launches
(a :class:`~.decode_attention.DecodePlan`'s sites keep them). Later launches with the same
fingerprint call the compiled kernel's launcher directly, with the argument list Triton's
binder would have made (the positional arguments, then each constexpr parameter's value in
signature order). Anything else (the interpreter, a launch hook such as a profiler's, a
Triton whose compiled kernels lack the launcher fields read here, a kernel replaced on its
module, as tests and benchmarks do) takes Triton's own path.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class DirectLaunch:
    """One launch site of ``kernel`` (a ``JITFunction``) with constexpr keyword arguments
    ``consts`` (``num_warps``, ``launch_pdl`` and the like included), launched by
    :meth:`__call__` with ``grid`` (three ints) and the positional arguments.

    enabled: False takes Triton's path on every launch (``DecodeConfig.direct_launch``;
    always for a ``kernel`` that is no ``JITFunction``, as under the interpreter, which
    compiles nothing). one_specialization: the owner launches the site only with arguments
    Triton would specialize alike (its own key covers every argument's dtype, 16-byte
    alignment and int value, as a :class:`~.decode_attention.DecodePlan`'s does), so no
    fingerprint is taken (~2-4 µs a launch on a GPU machine's host)."""

    __slots__ = (
        "kernel",
        "consts",
        "enabled",
        "one_specialization",
        "_compiled",
        "_tensor_pos",
        "_int_pos",
        "_n",
    )

    def __init__(
        self, kernel: Any, consts: dict, enabled: bool = True, one_specialization: bool = False
    ) -> None:
        self.kernel = kernel
        self.consts = consts
        # (a test's or benchmark's stand-in, or the interpreter's function: Triton's path)
        self.enabled = enabled and isinstance(kernel, JITFunction)
        self.one_specialization = one_specialization
        self._compiled: dict[tuple, tuple] = {}
        self._tensor_pos: tuple[int, ...] = ()
        self._int_pos: tuple[int, ...] = ()
        self._n = -1  # positional arguments the positions above were read from

    def __call__(self, kernel: Any, grid: tuple[int, int, int], args: tuple) -> None:
        """Launch ``kernel`` (the site's kernel as its module holds it now: a different
        object, e.g. a test's stand-in, takes Triton's path) on ``grid`` with ``args``."""
        if not self.enabled or kernel is not self.kernel or _hooked():
            kernel[grid](*args, **self.consts)
            return
        device = driver.active.get_current_device()
        if self.one_specialization:
            key: tuple = (device,)
        else:
            if len(args) != self._n:
                self._n = len(args)
                self._tensor_pos = tuple(
                    i for i, a in enumerate(args) if isinstance(a, torch.Tensor)
                )
                self._int_pos = tuple(
                    i for i, a in enumerate(args) if isinstance(a, int) and not isinstance(a, bool)
                )
                self._compiled.clear()
            key = (
                device,
                *[(args[i].dtype, args[i].data_ptr() & 15 == 0) for i in self._tensor_pos],
                *[args[i] for i in self._int_pos],
            )
        hit = self._compiled.get(key)
        if hit is not None:
            run, function, metadata, tail = hit
            stream = driver.active.get_current_stream(device)
            run(*grid, stream, function, metadata, None, None, None, *args, *tail)
            return
        compiled = kernel[grid](*args, **self.consts)  # Triton's path (compiles if needed)
        entry = _launcher_entry(kernel, compiled, len(args), self.consts)
        if entry is None:  # a Triton this cannot follow: its path from now on
            self.enabled = False
        else:
            if len(self._compiled) >= _MAX_SPECIALIZATIONS:
                self._compiled.clear()
            self._compiled[key] = entry


#: compiled kernels one site keeps (its plan's calls differ only in tensor alignment)
_MAX_SPECIALIZATIONS = 16


def _launcher_entry(kernel: Any, compiled: Any, n_args: int, consts: dict) -> tuple | None:
    """(launcher, function handle, packed metadata, constexpr tail) of a compiled kernel,
    or None where this Triton's objects lack them."""
    try:
        params = kernel.params
        tail = []
        for p in params[n_args:]:
            if not p.is_constexpr:
                return None  # a runtime parameter left to its default: not handled here
            value = consts.get(p.name, p.default)
            if value is inspect.Parameter.empty:
                return None  # (Triton's binder would refuse the launch first)
            tail.append(value)
        if hasattr(compiled, "result"):  # (an asynchronous compile's future)
            compiled = compiled.result()
        compiled._init_handles()
        return compiled.run, compiled.function, compiled.packed_metadata, tuple(tail)
    except (AttributeError, KeyError, TypeError):
        return None


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's): launches then go through Triton, which
    calls it. (Triton 3.6 holds None or a function; later ones a chain of hooks.)"""
    rt = knobs.runtime
    return _set(rt.launch_enter_hook) or _set(rt.launch_exit_hook)


def _set(hook: Any) -> bool:
    return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))
