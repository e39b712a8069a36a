"""Reader and writer for the IDX format of MNIST-style files, raw or gzip-compressed.

IDX layout (big-endian): a 4-byte magic ``0x00 0x00 T n`` where ``T`` is the element type code and
``n`` the number of dimensions, then ``n`` uint32 dimension sizes, then the elements in row-major
order. MNIST label files have magic 2049 (``T = 0x08`` uint8, ``n = 1``) and image files 2051
(uint8, ``n = 3``).

Every problem with a file (missing, unreadable, bad gzip stream, wrong magic, unknown type code,
header or body shorter or longer than the header declares, md5 mismatch) raises
:class:`DataFileError`, whose message starts with the file's path and says what is wrong.

>>> import numpy as np, tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "labels-idx1-ubyte.gz"
>>> write_idx(path, np.array([3, 1, 4], dtype=np.uint8))
>>> read_idx(path, expected_magic=2049)
array([3, 1, 4], dtype=uint8)
"""

from __future__ import annotations

import gzip
import hashlib
import math
import os
import zlib
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "IDX_IMAGES_MAGIC",
    "IDX_LABELS_MAGIC",
    "DataFileError",
    "MissingDataFileError",
    "decode_idx",
    "md5_hex",
    "read_bytes",
    "read_idx",
    "write_idx",
]

IDX_LABELS_MAGIC = 2049  # 0x00000801: uint8, 1 dimension
IDX_IMAGES_MAGIC = 2051  # 0x00000803: uint8, 3 dimensions

# IDX element type code -> big-endian numpy dtype.
_IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


class DataFileError(ValueError):
    """A data file is missing, truncated, corrupt or not what was expected.

    ``path`` is the offending file (or directory), or None when no location was given at all; the message
    starts with the path and says what is wrong.
    """

    def __init__(self, path: str | os.PathLike[str] | None, problem: str):
        self.path = Path(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path is not None else problem)


class MissingDataFileError(DataFileError, FileNotFoundError):
    """A :class:`DataFileError` for a file or directory that does not exist (also a FileNotFoundError)."""


def md5_hex(data: bytes) -> str:
    """Hex md5 digest of ``data`` (for integrity checks only, not security)."""
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise MissingDataFileError(path, "file does not exist") from None
    except IsADirectoryError:
        raise DataFileError(path, "is a directory, expected a file") from None
    except OSError as err:
        raise DataFileError(path, f"cannot be read ({err.strerror or err})") from err


def _decompress(path: Path, data: bytes) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as err:
        raise DataFileError(path, f"corrupt or truncated gzip stream ({err})") from err


def read_bytes(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """Return ``(file_bytes, content)``: the bytes on disk and the (decompressed) content.

    A file is treated as gzip when it starts with the gzip magic ``1f 8b``; a ``.gz`` name without that
    magic is an error (a silently uncompressed ``.gz`` is almost always a broken download).
    """
    path = Path(path)
    data = _read_file(path)
    if data[:2] == _GZIP_MAGIC:
        return data, _decompress(path, data)
    if path.suffix == ".gz":
        raise DataFileError(path, "name ends in .gz but the file is not gzip-compressed (bad gzip magic)")
    return data, data


def _shape_str(dims: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in dims)


def decode_idx(content: bytes, source: str | os.PathLike[str], expected_magic: int | None = None) -> np.ndarray:
    """Parse decompressed IDX bytes into a native-endian numpy array; ``source`` names the file in errors.

    Checks the magic (two zero bytes, a known type code, ``ndim >= 1``; ``expected_magic`` if given),
    that the header fits, and that the body holds exactly ``prod(dims) * itemsize`` bytes.
    """
    if len(content) < 4:
        raise DataFileError(source, f"truncated: {len(content)} bytes, too short for the 4-byte IDX magic")
    magic = int.from_bytes(content[:4], "big")
    zero, type_code, ndim = int.from_bytes(content[:2], "big"), content[2], content[3]
    if expected_magic is not None and magic != expected_magic:
        raise DataFileError(
            source, f"wrong magic number {magic} (0x{magic:08x}), expected {expected_magic} (0x{expected_magic:08x})"
        )
    if zero != 0 or type_code not in _IDX_TYPES or ndim < 1:
        raise DataFileError(
            source,
            f"not an IDX file: magic 0x{magic:08x} must be 00 00 <type> <ndim> with type in "
            f"{{{', '.join(f'0x{t:02x}' for t in _IDX_TYPES)}}} and ndim >= 1",
        )
    header = 4 + 4 * ndim
    if len(content) < header:
        raise DataFileError(
            source, f"truncated header: {ndim} dimensions need {header} header bytes, file holds {len(content)}"
        )
    dims = tuple(int.from_bytes(content[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = _IDX_TYPES[type_code]
    expected = header + math.prod(dims) * dtype.itemsize
    if len(content) != expected:
        kind = "truncated" if len(content) < expected else "wrong length (trailing bytes)"
        raise DataFileError(
            source,
            f"{kind}: header declares {_shape_str(dims)} {dtype.name} values, i.e. {expected} bytes in all, "
            f"but the (decompressed) file holds {len(content)} bytes",
        )
    array = np.frombuffer(content, dtype=dtype, offset=header).reshape(dims)
    return array.astype(dtype.newbyteorder("="), copy=True)  # writable, native byte order


def read_idx(
    path: str | os.PathLike[str], expected_magic: int | None = None, md5: str | None = None
) -> np.ndarray:
    """Read an IDX file (raw or gzip) into a writable native-endian numpy array.

    ``expected_magic``: e.g. :data:`IDX_IMAGES_MAGIC` (2051) or :data:`IDX_LABELS_MAGIC` (2049).
    ``md5``: expected hex md5 of the *decompressed* content (so the same digest holds for a raw file
    and any gzip recompression of it). Raises :class:`DataFileError` naming the file on any problem.
    """
    _, content = read_bytes(path)
    if md5 is not None:
        got = md5_hex(content)
        if got != md5.lower():
            raise DataFileError(path, f"md5 of the decompressed content is {got}, expected {md5.lower()}")
    return decode_idx(content, path, expected_magic)


def write_idx(path: str | os.PathLike[str], array: np.ndarray | torch.Tensor, compress: bool | None = None) -> None:
    """Write ``array`` as an IDX file; gzip-compressed when ``compress`` is True (default: name ends in .gz)."""
    path = Path(path)
    arr = array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
    codes = {dt.newbyteorder("="): code for code, dt in _IDX_TYPES.items()}
    native = arr.dtype.newbyteorder("=")
    if native not in codes:
        raise TypeError(f"write_idx: dtype {arr.dtype} has no IDX type code; use one of {sorted(map(str, codes))}")
    if arr.ndim < 1 or arr.ndim > 255:
        raise ValueError(f"write_idx: need 1 to 255 dimensions, got array of shape {arr.shape}")
    if any(d >= 2**32 for d in arr.shape):
        raise ValueError(f"write_idx: dimension sizes must fit in uint32, got shape {arr.shape}")
    header = bytes([0, 0, codes[native], arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    body = np.ascontiguousarray(arr, dtype=_IDX_TYPES[codes[native]]).tobytes()
    data = header + body
    if compress if compress is not None else path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)
