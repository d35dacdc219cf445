"""WebDataset tar shards: scanning samples with their byte locations, and reading one back.

Files are grouped into samples by WebDataset's own rule (``base_plus_ext``: the key is the
name up to the first dot of the basename; consecutive files with the same key form a sample;
its regex is copied here: importing ``webdataset`` imports torch, and ``check-config`` samples
shards without it). The scan records where each file's bytes lie in the (uncompressed) tar, so
a sample can be read later by seeking, without reading the shard from its start.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from dataclasses import dataclass, field

from mimo.core.errors import DataError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
VIDEO_EXTS = ("mp4", "webm", "mkv", "mov", "avi")
_IMAGE_KEY = re.compile(r"^(?:(\d+)\.)?(jpg|jpeg|png|webp)$")
_VIDEO_KEY = re.compile(r"^(?:(\d+)\.)?(mp4|webm|mkv|mov|avi)$")
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext's


@dataclass
class SampleLocation:
    key: str
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # ext -> (offset, size)


def _split_name(name: str) -> tuple[str, str] | None:
    m = _BASE_PLUS_EXT.match(name)
    return None if m is None else (m.group(1), m.group(2).lower())


def scan_shard(path: str, limit: int | None = None) -> tuple[list[SampleLocation], str | None]:
    """Samples of a shard in order, and an error text if the tar ends early or is unreadable.
    ``limit``: stop after that many samples (complete: the next one has begun), unchecked beyond."""
    samples: list[SampleLocation] = []
    end = 0  # where the last member's data ends (rounded to the 512-byte block)
    try:
        size = _file_size(path)
        with tarfile.open(path, "r:") as tf:
            for member in tf:
                end = member.offset_data + -(-member.size // 512) * 512
                if not member.isfile():
                    continue
                split = _split_name(member.name)
                if split is None:
                    continue
                key, ext = split
                if member.offset_data + member.size > size:
                    return samples, f"truncated tar: {member.name} ends past the end of the file"
                if not samples or samples[-1].key != key:
                    if limit is not None and len(samples) == limit:
                        return samples, None
                    samples.append(SampleLocation(key))
                samples[-1].files[ext] = (member.offset_data, member.size)
    except (tarfile.TarError, EOFError, OSError) as e:
        return samples, f"truncated or unreadable tar: {e}"
    # A complete tar ends with two zero blocks; a file cut between members lacks them, and
    # its last sample may have lost files.
    with open(path, "rb") as f:
        f.seek(end)
        tail = f.read(1024)
    if len(tail) < 1024 or tail.strip(b"\0"):
        return samples, "truncated tar: no end-of-archive marker"
    return samples, None


def _file_size(path: str) -> int:
    return os.path.getsize(path)


def read_files(path: str, loc: SampleLocation) -> dict[str, bytes]:
    """The bytes of every file of one sample."""
    out = {}
    with open(path, "rb") as f:
        for ext, (offset, size) in loc.files.items():
            f.seek(offset)
            data = f.read(size)
            if len(data) != size:
                raise DataError(f"{path}: {loc.key}.{ext} is truncated")
            out[ext] = data
    return out


def _numbered(files: dict, pattern: re.Pattern) -> list[str]:
    found = []
    for ext in files:
        m = pattern.match(ext)
        if m:
            found.append((int(m.group(1) or 0), ext))
    return [ext for _, ext in sorted(found)]


def image_keys(files: dict) -> list[str]:
    """Image file extensions of a sample in order (``png`` or ``0.png``, ``1.jpg``, ...)."""
    return _numbered(files, _IMAGE_KEY)


def video_keys(files: dict) -> list[str]:
    """Video file extensions of a sample in order (``mp4`` or ``0.mp4``, ``1.webm``, ...)."""
    return _numbered(files, _VIDEO_KEY)


def parse_text(files: dict[str, bytes]):
    """The sample's text part: ('json', obj) or ('txt', caption); DataError if neither works."""
    if "json" in files:
        try:
            return "json", json.loads(files["json"].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"invalid json: {e}") from None
    if "txt" in files:
        try:
            return "txt", files["txt"].decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"invalid txt: {e}") from None
    raise DataError("missing key: neither json nor txt")


def decode_image(data: bytes):
    """A PIL RGB image; DataError for corrupt or truncated bytes."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise DataError(f"corrupt image: {e}") from None
