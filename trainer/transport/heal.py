"""Heal state over the TLS transport: a torchft CheckpointTransport that moves tensors, never pickles.

torchft's default (HTTPTransport) serves the state over plain HTTP and loads it with
`torch.load(weights_only=False)`: whoever answers can make the healing site run code. Here the
state travels over the quorum's authenticated mesh (`ProcessGroupTls`), from the source replica
to the healing one, encoded as safetensors: the tensors as raw bytes, the tree around them
(dicts, lists, tuples, numbers, strings, booleans, None) as JSON in the safetensors metadata.
Decoding builds only those types; anything else is refused when encoding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from trainer.transport.tls import TransportError


class HealFormatError(TransportError):
    """Heal state that is not a tree of tensors and plain values."""


def _enc(x: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = x.detach().to("cpu").contiguous().clone()  # safetensors refuses shared storage
        return {"T": name}
    if isinstance(x, dict):
        return {"d": [[_enc(k, tensors), _enc(v, tensors)] for k, v in x.items()]}
    if isinstance(x, list):
        return {"l": [_enc(v, tensors) for v in x]}
    if isinstance(x, tuple):
        return {"t": [_enc(v, tensors) for v in x]}
    if x is None or isinstance(x, bool | int | float | str):
        return {"v": x}
    raise HealFormatError(f"heal state holds a {type(x).__name__}: only tensors, numbers, strings, None, "
                          f"lists, tuples and dicts cross the wire")


def _dec(x: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(x, dict) or len(x) != 1:
        raise HealFormatError("heal state: malformed tree node")
    (tag, val), = x.items()
    if tag == "T" and isinstance(val, str) and val in tensors:
        return tensors[val]
    if tag == "d" and isinstance(val, list):
        out = {}
        for kv in val:
            if not isinstance(kv, list) or len(kv) != 2:
                raise HealFormatError("heal state: malformed dict entry")
            k = _dec(kv[0], tensors)
            if not isinstance(k, bool | int | float | str | type(None)):
                raise HealFormatError("heal state: a dict key that is not a plain value")
            out[k] = _dec(kv[1], tensors)
        return out
    if tag in ("l", "t") and isinstance(val, list):
        items = [_dec(v, tensors) for v in val]
        return items if tag == "l" else tuple(items)
    if tag == "v" and (val is None or isinstance(val, bool | int | float | str)):
        return val
    raise HealFormatError(f"heal state: unknown or malformed node {tag!r}")


def encode(state: Any) -> bytes:
    """`state` as safetensors bytes (tree in the metadata)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    tree = _enc(state, tensors)
    return save(tensors, metadata={"dilococtl-tree": json.dumps(tree)})


def decode(data: bytes | bytearray) -> Any:
    """The tree `encode` made; HealFormatError for anything else. Never unpickles."""
    from safetensors.torch import load

    try:
        tensors = load(bytes(data))
        n = int.from_bytes(bytes(data[:8]), "little")
        meta = json.loads(bytes(data[8:8 + n])).get("__metadata__", {})
        tree = json.loads(meta["dilococtl-tree"])
    except HealFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the parser said, the bytes are not heal state
        raise HealFormatError(f"heal state is not a dilococtl safetensors tree: {e}") from None
    return _dec(tree, tensors)


class TlsCheckpointTransport:
    """torchft CheckpointTransport over a ProcessGroupTls: the source sends, the healer receives.

    Both calls happen inside the quorum, after the process group was configured for it, so the
    stream between source and healer is the quorum's authenticated one. `max_bytes` caps what a
    healer reads (a number, or a function asked at each heal: trainer.outer.heal_guard derives it from the
    site's own state); a source announcing more is refused before anything is allocated. Without
    it this transport only sends.
    """

    def __init__(self, pg, max_bytes: int | Callable[[], int] | None = None):
        self.pg = pg
        self.max_bytes = max_bytes

    def cap(self) -> int:
        """The most bytes of heal state this healer reads now."""
        if self.max_bytes is None:
            raise TransportError("heal: no size cap for received state (this transport only sends)")
        return int(self.max_bytes() if callable(self.max_bytes) else self.max_bytes)

    def metadata(self) -> str:
        return "dilococtl-tls"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        data = encode({"step": step, "state": state_dict})
        for r in dst_ranks:
            self.pg.live().send_blob(r, data, timeout.total_seconds())

    def disallow_checkpoint(self) -> None:
        pass  # sending is synchronous: nothing is left to read the state after send_checkpoint

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        if metadata != self.metadata():
            raise TransportError(f"heal source offers {metadata!r}, not this transport")
        got = decode(self.pg.live().recv_blob(src_rank, self.cap(), timeout.total_seconds()))
        if not isinstance(got, dict) or got.get("step") != step:
            raise TransportError(f"heal source sent the state of step {got.get('step') if isinstance(got, dict) else '?'}, "
                                 f"expected step {step}")
        return got["state"]

    def shutdown(self, wait: bool = True) -> None:
        pass


def checkpoint_transport(pg, max_bytes: int | Callable[[], int] | None = None):
    """A TlsCheckpointTransport that is also a torchft CheckpointTransport (for Manager's type checks)."""
    from torchft.checkpointing.transport import CheckpointTransport

    class _Transport(TlsCheckpointTransport, CheckpointTransport):
        pass

    return _Transport(pg, max_bytes)
