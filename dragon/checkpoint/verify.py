"""Checkpoints that prove they are whole.

A completion marker says that every rank wrote its files; a file truncated later (a partial copy,
a bad disk, a full disk during a sync) would still load as garbage or end a resume in tracebacks.
So the marker also lists every file of the checkpoint with its size and CRC-32. The rank that
writes a file checksums it as it writes it (dragon.checkpoint.stream) or right after; the marker's
writer checksums the few small files no rank reported. A resume, sample.py and export.py recompute
the sizes and checksums of the checkpoint they take before loading it (every rank, in preflight),
as the offline verifier (recipes/verify_checkpoints.py) does; a message at a stop compares sizes.
"""

import os
from typing import Optional

from zlib_ng.zlib_ng import crc32  # zlib's CRC-32, several times faster than zlib's own

CHUNK = 8 * 2**20


def crc32_of(path: str) -> int:
    """The CRC-32 of a file's bytes, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = crc32(block, crc)
    return crc


def files_of(tag_dir: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Every file under tag_dir, as paths relative to it, sorted; `skip` names left out."""
    found = []
    for parent, _, names in os.walk(tag_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), tag_dir)
            if rel not in skip:
                found.append(rel)
    return sorted(found)


def manifest(tag_dir: str, checksums: dict[str, int], skip: tuple[str, ...] = ()) -> dict:
    """{relative path: [size, crc32]} of every file under tag_dir. `checksums` holds the CRC-32s
    its writers computed, by absolute path; the others are computed here."""
    listed = {}
    for rel in files_of(tag_dir, skip):
        path = os.path.abspath(os.path.join(tag_dir, rel))
        crc = checksums.get(path)
        listed[rel] = [os.path.getsize(path), crc32_of(path) if crc is None else crc]
    return listed


def damage(tag_dir: str, files: Optional[dict], checksums: bool = False) -> Optional[str]:
    """Why the checkpoint in tag_dir does not match its marker's file list, or None when it
    does (or when the marker predates file lists). `checksums`: also recompute every CRC-32."""
    for rel, (size, crc) in sorted((files or {}).items()):
        path = os.path.join(tag_dir, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != size:
            return f"{rel} holds {os.path.getsize(path)} bytes, its marker says {size}"
        if checksums and crc is not None and crc32_of(path) != crc:
            return f"{rel} fails its CRC-32 check"
    return None
