"""How a checkpointed state dict is laid out for torch.distributed.checkpoint (DCP), and read back.

Non-tensor values (ints, floats, strings, lists, tuples, dicts, bytes, numpy arrays and RNG states)
are encoded as typed JSON into one bytes leaf per tensor-free subtree, which DCP stores as a bytes IO
item; loading replaces them whole. Nothing of ours is pickled. Tensors stay
DCP tensors and are loaded into the caller's tensors in place (DTensor shards included). Each rank
also saves a skeleton of its state (real key types, tensor shapes), so a value that holds no tensors
at load time (a fresh optimizer's empty `state`) is replaced by the saved subtree. DCP keeps one
copy of a non-tensor value per key across ranks: per-rank values need per-rank keys. The
Checkpointer (trainer.checkpoints.checkpoint) saves `pack_state(state)` plus `skeleton(state)` under
`skeleton_key(rank)`, and loads into `pack_target(state, ...)`, then `unpack_into(state, ...)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trainer import jsonwire
from trainer.checkpoints.checkpoint_trust import CheckpointError


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_tensor(v) for v in value)
    return False


def _pack_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping) and _has_tensor(value):
        return {k: _pack_value(v) for k, v in value.items()}
    if isinstance(value, list) and _has_tensor(value):
        return [_pack_value(v) for v in value]
    # One opaque leaf per tensor-free subtree: DCP would otherwise split it into per-key items whose
    # structure the loading side must reproduce exactly (an RNG state dict, an int-keyed mapping).
    try:
        return jsonwire.dumps(value)
    except TypeError as e:
        raise CheckpointError(f"cannot checkpoint this value: {e}") from None


def pack_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's view of `state`: the same tensors, every tensor-free subtree as typed JSON bytes."""
    if not isinstance(state, Mapping):
        raise ValueError(f"checkpoint state must be a dict, got {type(state).__name__}")
    return {k: _pack_value(v) for k, v in state.items()}


def skeleton_key(rank: int) -> str:
    return f"_checkpointer_skeleton_rank{rank}"


class _TensorSpec(tuple):
    """(shape, dtype) of a saved tensor in a skeleton; a distinct type so no saved tuple is mistaken for it."""


_OPAQUE = "opaque"  # skeleton leaf for a JSON-encoded tensor-free subtree


def skeleton(value: Any) -> Any:
    """The saved structure with real key types: containers that hold tensors, tensor specs, opaque leaves.

    DCP keys everything by dotted strings, so it alone could not rebuild an int-keyed optimizer state.
    """
    if isinstance(value, torch.Tensor):
        return {"tensor": [list(value.shape), str(value.dtype).removeprefix("torch.")]}
    if isinstance(value, Mapping) and _has_tensor(value):
        return {"map": [[k, skeleton(v)] for k, v in value.items()]}
    if isinstance(value, list) and _has_tensor(value):
        return {"seq": [skeleton(v) for v in value]}
    return _OPAQUE


def skeleton_from_json(tree: Any) -> Any:
    """The skeleton `skeleton` saved, as _build and pack_target read it (dicts, lists, _TensorSpec)."""
    if tree == _OPAQUE:
        return _OPAQUE
    if isinstance(tree, dict) and len(tree) == 1:
        (tag, body), = tree.items()
        if tag == "tensor":
            shape, dtype = body
            dt = getattr(torch, str(dtype), None)
            if not isinstance(dt, torch.dtype):
                raise CheckpointError(f"skeleton names an unknown dtype {dtype!r}")
            return _TensorSpec((tuple(int(n) for n in shape), dt))
        if tag == "map":
            return {k: skeleton_from_json(v) for k, v in body}
        if tag == "seq":
            return [skeleton_from_json(v) for v in body]
    raise CheckpointError("checkpoint skeleton is malformed")


def _build(skel: Any) -> Any:
    """A fresh DCP target for a saved subtree: new tensors, placeholders for opaque leaves."""
    if isinstance(skel, _TensorSpec):
        shape, dtype = skel
        return torch.empty(shape, dtype=dtype)
    if isinstance(skel, dict):
        return {k: _build(v) for k, v in skel.items()}
    if isinstance(skel, list):
        return [_build(v) for v in skel]
    return b""


def pack_target(target: Any, skel: Any) -> Any:
    """DCP's load target for `target`: its own tensors, and built ones where it holds none.

    A tensor-free value where the checkpoint has tensors (a fresh optimizer's empty `state`) is
    replaced by the saved subtree; keys the checkpoint lacks are left for DCP to report.
    """
    keys = list(target.keys()) if isinstance(target, Mapping) else range(len(target))
    out: Any = {} if isinstance(target, Mapping) else [None] * len(target)
    for k in keys:
        value = target[k]
        if isinstance(skel, dict):
            sub = skel.get(k, None)
        else:
            sub = skel[k] if isinstance(skel, list) and k < len(skel) else None
        if isinstance(value, torch.Tensor):
            out[k] = value
        elif sub is None:
            out[k] = _pack_value(value)
        elif not _has_tensor(value) and (isinstance(sub, (dict, list, _TensorSpec))):
            out[k] = _build(sub)
        elif isinstance(value, (Mapping, list)) and _has_tensor(value) and isinstance(sub, (dict, list)):
            out[k] = pack_target(value, sub)
        else:
            out[k] = _pack_value(value)
    return out


def _materialize(loaded: Any) -> Any:
    if isinstance(loaded, (bytes, bytearray)):
        return jsonwire.loads(loaded)
    if isinstance(loaded, dict):
        return {k: _materialize(v) for k, v in loaded.items()}
    if isinstance(loaded, list):
        return [_materialize(v) for v in loaded]
    return loaded


def unpack_into(target: Any, packed: Any) -> None:
    """Put loaded values from `packed` (built from `target`) back into `target`."""
    keys = list(target.keys()) if isinstance(target, Mapping) else range(len(target))
    for k in keys:
        orig, got = target[k], packed[k]
        if isinstance(orig, torch.Tensor):
            if got is not orig:  # DCP loads plain tensors in place; copy if it ever hands back a new one
                orig.copy_(got)
        elif isinstance(orig, (Mapping, list)) and _has_tensor(orig):
            unpack_into(orig, got)
        else:
            target[k] = _materialize(got)
