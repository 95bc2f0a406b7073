"""The transport's chunking leaves no stream of a ring step a chunk more than the others: paced at
1/S of the link each, the fullest stream sets the step's time."""

from __future__ import annotations

import math

import pytest

from trainer.rules.chunk_rule import CHUNK_BYTES, MIN_CHUNK_BYTES, chunk_elems


def _loads(block: int, ce: int, streams: int) -> list[int]:
    loads = [0] * streams
    for c, off in enumerate(range(0, block, ce)):
        loads[c % streams] += min(ce, block - off)
    return loads


@pytest.mark.parametrize("streams", [1, 2, 3, 8, 16, 64])
@pytest.mark.parametrize("mib", [0.5, 3, 16, 20.63, 33, 64, 257.3])
def test_every_stream_carries_its_share_within_one_element_per_chunk_of_the_block(streams, mib):
    block = int(mib * 2**20 / 4)  # fp32 elements
    ce = chunk_elems(block, 4, streams)
    loads = _loads(block, ce, streams)
    n_chunks = math.ceil(block / ce)
    assert ce * 4 <= CHUNK_BYTES + 4
    if block * 4 >= 2 * streams * MIN_CHUNK_BYTES:  # big enough to give every stream two chunks
        assert n_chunks % streams == 0 and n_chunks >= 2 * streams
        assert max(loads) - min(loads) < n_chunks, loads  # the last chunk is short by the rounding
    assert sum(loads) == block


def test_the_block_that_left_four_streams_a_chunk_more():
    # the small preset over 2 sites: a 20.63 MiB block; 1 MiB chunks made 21 of them over S = 8
    ce = chunk_elems(5_409_216, 4, 8)
    assert math.ceil(5_409_216 / ce) == 24 and max(_loads(5_409_216, ce, 8)) <= 5_409_216 // 8 + 3


def test_small_blocks_keep_the_floor_and_a_tiny_block_is_one_chunk():
    assert chunk_elems(62_625, 4, 4) * 4 == MIN_CHUNK_BYTES  # the tiny model's block: one 64 KiB chunk per stream
    assert chunk_elems(10, 4, 8) == 10 and chunk_elems(0, 4, 8) == 1
    # 100 kB of bytes, 4 kB chunks at most, S = 8: 4 per stream, 32 chunks of 3,125 bytes
    assert chunk_elems(100_000, 1, 8, chunk_bytes=4096, min_chunk_bytes=256) == 3125
