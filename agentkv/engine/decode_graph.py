"""A decode step of the model as one CUDA graph replay.

On the kernels' decode path (:class:`KernelDecode`) a step launches the same kernels on the
same buffers as the step before it: the new token's id and position, its cells (one per
layer and KV head) and the decode index's contents change, but no buffer address and none of
the plan's host bounds (:attr:`KernelDecode.bounds`) do within one
:attr:`KernelDecode.epoch` (a new index, or a quantized segment grown past its bound's
slack: every 16 decode-time pages). Eager, batch-1 decode of a transformers model is bound by
the host (30-47 ms a step at SmolLM2's and an 8B shape on an H200, for a few ms of GPU work;
docs/benchmarks.md §3 session 32), so :class:`DecodeGraph` captures the step once per epoch
and replays it:

- the step's inputs live in static device buffers, filled from a pinned host buffer by a
  single copy (token id, position, ``[L * Hkv]`` cells); the token id can come from the
  device instead (:meth:`DecodeGraph.feed`: sampled from the previous step's logits into the
  input buffer), so the engine launches a step before it has read
  the token the step feeds (it reads it while the step runs; two pinned buffers take turns,
  so one step's copy never reads a buffer the next step's inputs are written to);
- the first step of an epoch runs eagerly (its logits are the step's result; it also
  compiles any new kernel variant and builds the decode plans, neither of which may happen
  during a capture), then the same forward is captured (about one eager step's host time);
  later steps of the epoch replay;
- a capture that fails (something in the forward that cannot be captured) leaves the engine
  decoding eagerly, with a warning and :attr:`DecodeGraph.failed`.

Captures share one memory pool (a ``torch.cuda.MemPool`` the engine holds), so an epoch's
graph reuses the previous one's memory. The decode plans a graph's kernels were built from are
held with it (their scratch buffers must outlive the graph).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from agentkv.engine.kernel_decode import KernelDecode
from agentkv.kernels import held_decode_plans
from agentkv.methods import PrefillObserver

log = logging.getLogger(__name__)

#: ``(input_ids [1, 1], positions [1], write_slots [L * Hkv, 1], kernel, observer) ->
#: logits [V]``, every tensor on the device; ``observer``: the method's decode-time observer
#: or None (it records what it needs from inside the capture)
StepForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, KernelDecode, PrefillObserver | None],
    torch.Tensor,
]


class DecodeGraph:
    """An engine's decode steps, replayed from a CUDA graph per decode-index epoch.

    One per engine (requests are served one at a time): :meth:`begin` starts a request's
    decode, :meth:`step` runs each of its steps, :meth:`end` drops its graph.

    Args:
        forward: runs the model for one token over a request's kernel decode state; must not
            synchronize with the device (it is captured).
        num_cells: cells a step writes (layers x KV heads).
        device: the CUDA device.
        dtype: the model's activations (what an observer's capture buffers hold).
    """

    def __init__(
        self, forward: StepForward, num_cells: int, device: torch.device, dtype: torch.dtype
    ):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.forward = forward
        self.dtype = dtype
        # two pinned input buffers taking turns: a step's inputs are written while the step
        # before it (whose copy may not have run yet) is still queued
        self._hosts = [
            torch.empty(2 + num_cells, dtype=torch.int64, pin_memory=True) for _ in range(2)
        ]
        self._turn = 0
        self._dev = torch.empty(2 + num_cells, dtype=torch.int64, device=device)
        self._token_host = torch.empty(1, dtype=torch.int64, pin_memory=True)
        self._token_ready = torch.cuda.Event()
        self.input_ids = self._dev[0:1].view(1, 1)
        self.positions = self._dev[1:2]
        self.write_slots = self._dev[2:].view(num_cells, 1)
        # one private pool shared by every capture, held here: a graph's output can outlive
        # the graph (the caller's logits when a new epoch replaces it), and a pool whose last
        # graph died while blocks were out fails an allocator assert when captured into again
        self._mempool = torch.cuda.MemPool()
        self.stream = torch.cuda.Stream(device)
        self.kernel: KernelDecode | None = None
        self.observer: PrefillObserver | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        self._plans: list[Any] = []
        self._epoch = -1  # the kernel's epoch the graph was captured in
        #: set when a capture failed: later steps run eagerly (the error, for telemetry)
        self.failed: str | None = None
        #: graphs captured (one per index epoch) and steps replayed, over the engine's life
        self.captures = 0
        self.replays = 0

    def _end_pool_capture(self) -> None:
        """After a capture that failed: ``CUDAGraph.capture_end`` raised before it told the
        caching allocator the capture into our pool had ended, and the allocator, still
        counting it, would abort the process when the pool is freed. Tell it. (The pool
        keeps the reference the capture took: its few blocks stay until the process ends.)"""
        with contextlib.suppress(RuntimeError):  # (it was told: nothing underway)
            torch._C._cuda_endAllocateToPool(self._dev.device.index, self._mempool.id)

    def __del__(self) -> None:
        # the graph and its output go before the pool they were allocated from (the
        # instance's attributes would otherwise be released in their insertion order)
        self.graph = None
        self._logits = None

    def begin(self, kernel: KernelDecode, observer: PrefillObserver | None = None) -> None:
        """A request's decode starts, over ``kernel``'s index; ``observer``: its method's
        decode-time observer (pruning while decoding), or None."""
        self._drop()
        self.kernel, self.observer = kernel, observer

    def end(self) -> None:
        """The request's decode ended: its graph (and the memory it pins) goes."""
        self._drop()
        self.kernel = self.observer = None

    def _drop(self) -> None:
        self.graph = None
        self._logits = None
        self._plans = []

    def feed(self, token: torch.Tensor) -> None:
        """Queue ``token`` (int64 ``[1]`` on the device, e.g. sampled from a step's logits
        and not computed yet) as the next step's input: it is copied into the input buffer
        and to the host behind it; :meth:`read_fed_token` waits for that copy. The next
        :meth:`step` must be called with ``token=None``."""
        self._dev[0:1].copy_(token)
        self._token_host.copy_(self._dev[0:1], non_blocking=True)
        self._token_ready.record()

    def read_fed_token(self) -> int:
        """The token :meth:`feed` queued (waits until it is computed)."""
        self._token_ready.synchronize()
        return int(self._token_host[0])

    def step(self, token: int | None, position: int, slots: torch.Tensor) -> torch.Tensor:
        """Logits (float32 ``[V]``) after ``token`` at ``position``, whose cells are
        ``slots`` (int64 ``[L * Hkv, 1]``, already appended to the kernel's index);
        ``token=None``: the token :meth:`feed` queued. Launches the step and returns
        without waiting for it."""
        kernel = self.kernel
        if kernel is None:
            raise RuntimeError("DecodeGraph.step outside begin() / end()")
        # one host-to-device copy from the buffer whose turn it is: the other one may still
        # be read by the previous step's copy; this one's last copy (two steps back) ran
        # before the caller read that step's token (a sync)
        host = self._hosts[self._turn]
        self._turn ^= 1
        host[1] = position
        host[2:] = slots.reshape(-1)
        if token is None:
            self._dev[1:].copy_(host[1:], non_blocking=True)
        else:
            host[0] = token
            self._dev.copy_(host, non_blocking=True)
        if self.graph is not None and self._epoch == kernel.epoch:
            self.graph.replay()
            self.replays += 1
            assert self._logits is not None
            return self._logits
        args = (self.input_ids, self.positions, self.write_slots, kernel, self.observer)
        if self.failed is not None:
            return self.forward(*args)
        cur = torch.cuda.current_stream(self._dev.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            # eager first: the step's result, and any kernel compile or plan it needs
            logits = self.forward(*args)
            graph = torch.cuda.CUDAGraph()
            if self.observer is not None:
                self.observer.before_capture(self._dev.device, self.dtype)
            try:
                with torch.cuda.graph(graph, pool=self._mempool.id, stream=self.stream):
                    out = self.forward(*args)
            except Exception as e:  # (not capturable here: decode eagerly from now on)
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed, decoding eagerly: %s", self.failed)
                graph = out = None
                self._end_pool_capture()
        cur.wait_stream(self.stream)
        if graph is not None:
            self.graph, self._logits, self._epoch = graph, out, kernel.epoch
            self._plans = held_decode_plans()
            self.captures += 1
        return logits
