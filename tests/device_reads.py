"""An emulated accelerator on the CPU, to count the device-to-host reads of code meant for a GPU.

:func:`on_device` wraps a CPU tensor as :class:`DeviceTensor`, whose ``device`` is ``meta``
(so code that branches on ``t.device`` takes its off-CPU path) and whose values are held on
the CPU. Inside ``with DeviceReads() as reads:`` every op on such tensors runs on their CPU
values and its tensor results are device tensors again; a tensor made with ``device=meta``
(``torch.zeros(n, device=k.device)``) or moved there (``t.to(k.device)``) is one too. What a
GPU would have to wait for is counted in ``reads.ops``:

- a copy of a device tensor to the CPU (``.cpu()``, ``.to("cpu")``, ``.tolist()``);
- ops whose result the host needs or whose output size depends on the values
  (``.item()``, ``bool(t)``, ``int(t)``, ``nonzero``, ``unique``, ``masked_select``,
  indexing with a boolean mask).

Host tensors are never counted, and ops that mix a device tensor with a host tensor of more
than zero dimensions (an error on a GPU, except host indices into a device tensor) are listed
in ``reads.mixed``.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

#: the device the emulated tensors report
DEVICE = torch.device("meta")

#: aten ops whose result the host waits for (on a device tensor)
READ_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",  # .item(), bool(t), int(t)
        "aten.nonzero.default",
        "aten._unique2.default",
        "aten.unique_consecutive.default",
        "aten.unique_dim.default",
        "aten.masked_select.default",
        "aten.is_nonzero.default",
        "aten.equal.default",
    }
)


def host_read(name: str, args: tuple) -> str | None:
    """What op ``name`` (``str(func)``) with ``args`` makes the host wait for, or None: one
    of :data:`READ_OPS`, or indexing with a boolean mask (its output size is the mask's)."""
    if name in READ_OPS:
        return name
    if name.startswith("aten.index.Tensor") and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
    ):
        return "bool-mask index"
    return None


#: ops that take host indices into a device tensor (allowed on a GPU)
_HOST_INDICES = {
    "aten.index.Tensor",
    "aten.index_put_.default",
    "aten.index_put.default",
    "aten.copy_.default",  # a host-to-device copy
}


class DeviceTensor(torch.Tensor):
    """A CPU tensor (``elem``) that reports ``device == meta``; only :class:`DeviceReads`
    runs ops on it."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> DeviceTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), dtype=elem.dtype, device=DEVICE
        )
        r.elem = elem
        return r

    def __repr__(self) -> str:
        return f"DeviceTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a DeviceTensor outside DeviceReads")


def on_device(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` (a CPU tensor) as a device tensor (None stays None)."""
    return None if t is None else DeviceTensor(t)


def _unwrap(x):
    return x.elem if isinstance(x, DeviceTensor) else x


def _wrap(x):
    return DeviceTensor(x) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x


class DeviceReads(TorchDispatchMode):
    """Counts device-to-host reads of :class:`DeviceTensor` s (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.mixed: list[str] = []
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        self.ops, self.mixed = [], []
        mode = self

        def tolist(t):
            if isinstance(t, DeviceTensor):
                mode.ops.append("tolist")
                return mode._tolist(t.elem)
            return mode._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    @property
    def count(self) -> int:
        return len(self.ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = str(func)
        flat, _ = tree_flatten((args, kwargs))
        on_dev = any(isinstance(x, DeviceTensor) for x in flat)
        to_dev = isinstance(kwargs.get("device"), torch.device) and kwargs["device"] == DEVICE
        if to_dev:
            kwargs["device"] = torch.device("cpu")
        to_host = not to_dev and getattr(kwargs.get("device"), "type", None) == "cpu"
        if name == "aten._to_copy.default" and isinstance(args[0], DeviceTensor) and to_host:
            self.ops.append("copy to host")
            return func(args[0].elem, **kwargs)
        if on_dev:
            self._check_mixed(name, flat)
            read = host_read(name, args)
            if read is not None:
                self.ops.append(read)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if name == "aten._local_scalar_dense.default" or not (on_dev or to_dev):
            return out
        if args and isinstance(args[0], DeviceTensor) and out is args[0].elem:
            return args[0]  # in place: the (wrapped) self
        return tree_map(_wrap, out)

    def _check_mixed(self, name: str, flat: list) -> None:
        host = [
            x
            for x in flat
            if isinstance(x, torch.Tensor) and not isinstance(x, DeviceTensor) and x.dim() > 0
        ]
        if host and not (name in _HOST_INDICES and isinstance(flat[0], DeviceTensor)):
            self.mixed.append(name)
