"""Typed JSON for tensor-free values, and object collectives that never unpickle.

torch's `broadcast_object_list` / `gather_object` pickle their objects and unpickle what arrives;
inside a site that puts pickle behind torchrun's store and process group (issue 34, finding 7:
the c10d TCPStore binds every interface). Here objects cross as JSON bytes in uint8 tensors, and
checkpoints store tensor-free values as the same JSON.

The codec is typed so that a value comes back as the type it went in: JSON's own None, bool, int,
float (NaN and infinities included) and str stay bare; every container and every other type is a
one-key object: {"list": [...]}, {"tuple": [...]}, {"dict": [[key, value], ...]} (keys of any
encodable type, e.g. an optimizer's int keys), {"bytes": base64}, {"ndarray": {...}} (numeric numpy
arrays; {"npscalar": {...}} for numpy scalars), {"dtype": "float32"} (a torch dtype). Anything else
is refused with a TypeError naming the type: nothing is ever executed or imported while decoding.
"""

from __future__ import annotations

import base64
import json
from typing import Any

MAX_BYTES = 256 << 20  # the biggest encoded object a collective accepts (a receiver allocates this much)
_NUMPY_KINDS = "biufc"  # numpy dtype kinds the codec stores: bool, ints, floats, complex (never object)


class WireError(ValueError):
    """Bytes that are not an encoding this codec made."""


def encode(value: Any) -> Any:
    """`value` as a JSON-ready tree (see the module doc); TypeError for a type it cannot store."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, list):
        return {"list": [encode(v) for v in value]}
    if isinstance(value, tuple):  # torch.Size, random.getstate(), numpy's legacy state...
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    mod = type(value).__module__.split(".")[0]
    if mod == "numpy":
        return _encode_numpy(value)
    if mod == "torch":
        import torch

        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
    raise TypeError(f"cannot store a value of type {type(value).__module__}.{type(value).__qualname__} as JSON")


def _encode_numpy(value: Any) -> Any:
    import numpy as np

    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
        if arr.dtype.kind not in _NUMPY_KINDS:
            raise TypeError(f"cannot store a numpy array of dtype {arr.dtype} as JSON")
        body = {"dtype": arr.dtype.str, "shape": list(arr.shape),
                "data": base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")}
        return {"npscalar" if isinstance(value, np.generic) else "ndarray": body}
    raise TypeError(f"cannot store a value of type numpy.{type(value).__qualname__} as JSON")


def decode(tree: Any) -> Any:
    """The value `encode` made `tree` from; WireError for anything it did not make."""
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if not (isinstance(tree, dict) and len(tree) == 1):
        raise WireError(f"not a typed value: {type(tree).__name__}")
    (tag, body), = tree.items()
    if tag in ("list", "tuple") and isinstance(body, list):
        items = [decode(v) for v in body]
        return items if tag == "list" else tuple(items)
    if tag == "dict" and isinstance(body, list):
        out = {}
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise WireError("a dict entry is not a [key, value] pair")
            out[decode(pair[0])] = decode(pair[1])
        return out
    if tag == "bytes" and isinstance(body, str):
        return base64.b64decode(body, validate=True)
    if tag in ("ndarray", "npscalar") and isinstance(body, dict):
        return _decode_numpy(tag, body)
    if tag == "dtype" and isinstance(body, str):
        import torch

        dt = getattr(torch, body, None)
        if not isinstance(dt, torch.dtype):
            raise WireError(f"unknown torch dtype {body!r}")
        return dt
    raise WireError(f"unknown tag {tag!r}")


def _decode_numpy(tag: str, body: dict) -> Any:
    import numpy as np

    try:
        dtype = np.dtype(str(body["dtype"]))
        shape = tuple(int(n) for n in body["shape"])
        data = base64.b64decode(str(body["data"]), validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"bad numpy value: {e}") from None
    if dtype.kind not in _NUMPY_KINDS:
        raise WireError(f"numpy dtype {dtype} is not stored by this codec")
    arr = np.frombuffer(data, dtype=dtype).copy().reshape(shape)
    return arr[()] if tag == "npscalar" else arr


def dumps(value: Any) -> bytes:
    """`value` as typed JSON bytes."""
    return json.dumps(encode(value), separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    """The value `dumps` made `data` from; WireError for anything else."""
    try:
        tree = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"not JSON: {e}") from None
    return decode(tree)


# ---------------------------------------------------------------------- collectives


def _device(group: Any):
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":  # NCCL moves CUDA tensors only
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_tensor(data: bytes, device: Any):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
        torch.empty(0, dtype=torch.uint8, device=device)


def _checked_len(n: int) -> int:
    if not 0 <= n <= MAX_BYTES:
        raise WireError(f"object of {n} bytes announced (at most {MAX_BYTES})")
    return n


def broadcast(value: Any, src: int = 0, group: Any = None) -> Any:
    """`value` of rank `src` (its rank in `group`) on every rank of `group`, as typed JSON in tensors."""
    import torch
    import torch.distributed as dist

    dev = _device(group)
    mine = dist.get_rank(group) == src
    data = dumps(value) if mine else b""
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    dist.broadcast(n, group=group, group_src=src)
    size = _checked_len(int(n.item()))
    buf = _as_tensor(data, dev) if mine else torch.empty(size, dtype=torch.uint8, device=dev)
    if size:
        dist.broadcast(buf, group=group, group_src=src)
    return value if mine else loads(buf.cpu().numpy().tobytes())


def gather(value: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
    """Every rank's `value` as a list on rank `dst` of `group` (None elsewhere), as typed JSON in tensors."""
    import torch
    import torch.distributed as dist

    dev = _device(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    data = dumps(value)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=dev), group=group)
    lens = [_checked_len(int(s.item())) for s in sizes]
    width = max(lens)
    buf = torch.zeros(width, dtype=torch.uint8, device=dev)
    buf[:len(data)] = _as_tensor(data, dev)
    parts = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(world)] if rank == dst else None
    dist.gather(buf, parts, group=group, group_dst=dst)
    if parts is None:
        return None
    return [loads(p[:k].cpu().numpy().tobytes()) for p, k in zip(parts, lens, strict=True)]
