"""Ingest: decompress a .gz input file, salvaging the complete lines before any damage."""

from __future__ import annotations

import gzip
import zlib

GZIP_MAGIC = b"\x1f\x8b"
SALVAGE_CHUNK = 4096  # compressed bytes fed at a time when salvaging a damaged .gz


def gunzip(data: bytes) -> tuple[bytes, tuple[bytes, str] | None]:
    """(decompressed bytes, None); for damaged data (the complete lines before the damage,
    (the partial line after them, what happened)): the records before the damage are kept."""
    try:
        return gzip.decompress(data), None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        first_error = f"{type(e).__name__}: {e}"
    out, at, problem = bytearray(), 0, None
    d = zlib.decompressobj(31)
    while problem is None:
        if d.eof:
            at -= len(d.unused_data)
            if at >= len(data):
                break
            if data[at : at + 2] != GZIP_MAGIC:
                problem = f"data after the end of the gzip stream at compressed byte {at} is not gzip"
                break
            d = zlib.decompressobj(31)
        if at >= len(data):
            problem = f"the file ends inside the gzip stream (truncated at compressed byte {len(data)})"
            break
        chunk = data[at : at + SALVAGE_CHUNK]
        try:
            out += d.decompress(chunk)
        except zlib.error as err:
            problem = f"corrupt gzip data near compressed byte {at} ({err})"
            break
        at += len(chunk)
    cut = out.rfind(b"\n") + 1
    return bytes(out[:cut]), (
        bytes(out[cut:]),
        f"{problem or first_error}; the records from decompressed byte {cut} on are lost",
    )
