"""The adapter update a device sends in a round, compressed: what both sides must agree on.

A device sends its *update* (trained adapter minus the global adapter it started from), not the
adapter. Each tensor, flattened, is quantized in blocks of ``BLOCK`` values to ``bits`` bits,
symmetric around zero with one float32 scale per block (the last block padded with zeros);
4-bit codes are packed two to a byte. A tensor whose update
is exactly zero (FFA-LoRA's frozen ``lora_A``) is not sent. ``bits`` 32 sends float32 updates.

Error feedback is the device's (``client.update_residual``): what quantization dropped in a round
is added to its next update.

On the wire the encoded arrays travel as **one** array, a safetensors file (``pack``/``unpack``):
Flower moves every ``Array`` of a message as its own request through the SuperNode and the
SuperLink, and a rank-8 update is 420 arrays (210 tensors, codes and scales). The file's header
(names, dtypes, shapes) costs about 130 bytes per array.

Sizes for SmolLM2-135M with rank-8 LoRA on every projection (2.44 M parameters): float32
9.8 MB, 8-bit 2.6 MB, 4-bit 1.4 MB; with FFA-LoRA (``lora_B`` only, 1.24 M values) about half.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord
from safetensors import SafetensorError
from safetensors.numpy import load, save

BITS = (4, 8, 32)
BLOCK = 64  # values per scale: 0.5 extra bits per value
CODE, SCALE = "::q", "::scale"  # array-name suffixes of a tensor's codes and its per-row scales
PACKED = "safetensors"  # the name of the one array of an update record: ``pack``'s file


class UpdateCodecError(ValueError):
    """An encoded update that does not fit the adapter (one line, for the round log)."""


def encode(delta: dict[str, np.ndarray], bits: int) -> dict[str, np.ndarray]:
    """``delta`` (name -> float array) as the arrays a reply carries; all-zero tensors are left out."""
    if bits not in BITS:
        raise ValueError(f"update bits must be one of {BITS}")
    out = {}
    for name, d in delta.items():
        d = np.asarray(d, dtype=np.float32)
        if not d.any():
            continue
        if bits == 32:
            out[name + CODE] = d.copy()
            continue
        rows = _blocks(d)
        qmax = 2 ** (bits - 1) - 1
        scale = np.abs(rows).max(axis=1) / qmax
        safe = np.where(scale > 0, scale, 1.0)
        q = np.clip(np.rint(rows / safe[:, None]), -qmax, qmax).astype(np.int8)
        out[name + CODE] = q if bits == 8 else _pack4(q)
        out[name + SCALE] = scale.astype(np.float32)
    return out


def decode(arrays: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The float32 update for every tensor in ``shapes`` (zeros where none was sent), from a
    reply's arrays. ``UpdateCodecError`` for a name, shape or dtype that does not fit."""
    names = {k[: -len(CODE)] for k in arrays if k.endswith(CODE)}
    extra = set(arrays) - {n + s for n in names for s in (CODE, SCALE)}
    if extra or names - set(shapes):
        raise UpdateCodecError(f"update array {sorted(extra or names - set(shapes))[0]!r} is not in the adapter")
    out = {}
    for name, shape in shapes.items():
        if name not in names:
            out[name] = np.zeros(shape, np.float32)
            continue
        code = np.asarray(arrays[name + CODE])
        size = int(np.prod(shape, dtype=np.int64))
        rows, width = -(-size // BLOCK), BLOCK
        if name + SCALE not in arrays:  # float32
            if code.dtype != np.float32 or code.shape != tuple(shape):
                raise UpdateCodecError(f"update {name}: {code.dtype}{list(code.shape)}, expected float32{list(shape)}")
            out[name] = code.astype(np.float32)
            continue
        scale = np.asarray(arrays[name + SCALE])
        if scale.dtype != np.float32 or scale.shape != (rows,):
            raise UpdateCodecError(f"update {name}: scales {scale.dtype}{list(scale.shape)}, expected float32[{rows}]")
        if code.dtype == np.int8 and code.shape == (rows, width):
            q = code
        elif code.dtype == np.uint8 and code.shape == (rows, (width + 1) // 2):
            q = _unpack4(code, width)
        else:
            raise UpdateCodecError(f"update {name}: codes {code.dtype}{list(code.shape)} fit no bit width")
        out[name] = (q.astype(np.float32) * scale[:, None]).ravel()[:size].reshape(shape)
    return out


def pack(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """``encode``'s arrays as one uint8 array: the bytes of a safetensors file holding them."""
    return np.frombuffer(save({k: np.ascontiguousarray(v) for k, v in arrays.items()}), np.uint8)


def unpack(packed: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays ``pack`` put in ``packed``; ``UpdateCodecError`` for anything else (safetensors
    parses untrusted files without executing them: a header that lies about sizes is refused)."""
    if packed.dtype != np.uint8 or packed.ndim != 1:
        raise UpdateCodecError(f"packed update: {packed.dtype}{list(packed.shape)}, expected uint8[n]")
    try:
        return load(packed.tobytes())
    except (SafetensorError, ValueError, TypeError) as exc:
        raise UpdateCodecError(f"packed update is not a safetensors file ({str(exc).splitlines()[0][:80]})") from None


def to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """``encode``'s arrays as the ``update`` record of a reply: one array, ``pack``'s file."""
    return ArrayRecord({PACKED: Array(pack(arrays))})


def from_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The arrays of an ``update`` record; ``UpdateCodecError`` unless it is exactly one packed file."""
    if list(record) != [PACKED]:
        raise UpdateCodecError(f"update record holds {sorted(record)[:3]}, expected one array {PACKED!r}")
    return unpack(record[PACKED].numpy())


def _blocks(d: np.ndarray) -> np.ndarray:
    """``d`` flattened and zero-padded into rows of ``BLOCK`` values."""
    flat = d.ravel()
    return np.concatenate([flat, np.zeros(-flat.size % BLOCK, flat.dtype)]).reshape(-1, BLOCK)


def _pack4(q: np.ndarray) -> np.ndarray:
    """int8 codes in -7..7 -> two per byte (low nibble first), +8 offset."""
    u = (q + 8).astype(np.uint8)
    if u.shape[1] % 2:
        u = np.concatenate([u, np.full((u.shape[0], 1), 8, np.uint8)], axis=1)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)


def _unpack4(packed: np.ndarray, width: int) -> np.ndarray:
    u = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    u[:, 0::2], u[:, 1::2] = packed & 0x0F, packed >> 4
    return u[:, :width].astype(np.int8) - 8
