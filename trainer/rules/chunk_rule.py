"""How the TLS transport cuts a ring block into chunks; shared by trainer/transport/comm.py, which
cuts, and dilococtl/tune/tls_model.py, which predicts (no torch here).

Chunk c of a block goes on stream c mod S, and a paced stream sends at its 1/S share whatever the
others do, so a block whose chunk count is not a multiple of S leaves some streams a chunk more than
the rest: the step lasts as long as the fullest stream. A 20.6 MiB block in 1 MiB chunks over S = 8
(21 chunks: four streams carry 3, four carry 2 or less) moved at 81% of the lab's 50 Mbit/s link where
a balanced block moved at 92% (BENCHMARKS.md, "The lab's window-limited link"). So the count is a
multiple of S, about two chunks per stream or more, each at most CHUNK_BYTES.
"""

from __future__ import annotations

import math

CHUNK_BYTES = 1 << 20  # largest chunk: one header per MiB
MIN_CHUNK_BYTES = 64 << 10  # smallest chunk (unless the block is smaller): headers stay < 0.1%


def chunk_elems(block_elems: int, itemsize: int, streams: int, chunk_bytes: int = CHUNK_BYTES,
                min_chunk_bytes: int = MIN_CHUNK_BYTES) -> int:
    """Elements per chunk of a `block_elems`-element block: the block in a multiple of `streams`
    chunks (two per stream at least) of at most `chunk_bytes`, none under `min_chunk_bytes`."""
    block = block_elems * itemsize
    per_stream = max(2, math.ceil(block / (streams * chunk_bytes)))
    want = math.ceil(block_elems / (streams * per_stream))
    return max(1, want, min(block_elems, min_chunk_bytes // itemsize))
