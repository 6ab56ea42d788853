"""Plain data across a trust boundary: a codec that can carry tensors but never code.

Unpickling runs code chosen by whoever wrote the bytes, so nothing a rank sends back is
unpickled where the rank's code is not trusted (the autograder's ranks run students'
code). This codec carries only ``None``, ``bool``, ``int``, ``float``, ``str``,
``bytes``, ``torch.Tensor``, ``torch.dtype``, ``torch.Size`` and lists, tuples and dicts
(str or int keys) of them: a JSON header describes the structure and each tensor's dtype,
shape and place in the binary part that follows. :func:`loads` checks every descriptor
before it builds anything, and builds nothing but those types.

    >>> loads(dumps({"loss": 2.5, "grad": torch.ones(3)}))
    {'loss': 2.5, 'grad': tensor([1., 1., 1.])}
"""
from __future__ import annotations

import json
import math
import struct

_HEADER = struct.Struct("<Q")
_MAX_DEPTH = 64


class PlainDataError(ValueError):
    """A value that is not plain data, or bytes that do not decode as plain data."""


def _dtypes():
    import torch

    return {str(d).removeprefix("torch."): d for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool)}


def dumps(obj) -> bytes:
    """Encode ``obj``; :class:`PlainDataError` names the first part that is not plain data."""
    import torch

    blobs: list[bytes] = []
    offset = 0

    def enc(x, depth, where):
        nonlocal offset
        if depth > _MAX_DEPTH:
            raise PlainDataError(f"{where}: nested deeper than {_MAX_DEPTH} levels")
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x if abs(x) < 2 ** 63 else {"int": str(x)}
        if isinstance(x, float):
            return x if math.isfinite(x) else {"float": repr(x)}
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple, torch.Size):
            items = [enc(v, depth + 1, f"{where}[{i}]") for i, v in enumerate(x)]
            return items if type(x) is list else {"tuple": items}
        if type(x) is dict:
            if not all(type(k) in (str, int) for k in x):
                raise PlainDataError(f"{where}: dict keys must be str or int")
            return {"dict": [[enc(k, depth + 1, where), enc(v, depth + 1, f"{where}[{k!r}]")]
                             for k, v in x.items()]}
        if isinstance(x, bytes):
            blobs.append(x)
            offset += len(x)
            return {"bytes": [offset - len(x), len(x)]}
        if isinstance(x, torch.dtype):
            return {"dtype": str(x).removeprefix("torch.")}
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            name = str(t.dtype).removeprefix("torch.")
            if name not in _dtypes():
                raise PlainDataError(f"{where}: tensors of dtype {name} cannot travel")
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            blobs.append(data)
            offset += len(data)
            return {"tensor": [name, list(t.shape), offset - len(data), len(data)]}
        raise PlainDataError(
            f"{where} is a {type(x).__module__}.{type(x).__qualname__}: only None, bool, int, "
            f"float, str, bytes, tensors, dtypes and lists/tuples/dicts of them can travel")

    header = json.dumps(enc(obj, 0, "the value")).encode()
    return _HEADER.pack(len(header)) + header + b"".join(blobs)


def loads(data: bytes):
    """Decode what :func:`dumps` made; anything else raises :class:`PlainDataError`."""
    import torch

    data = memoryview(data)
    if len(data) < _HEADER.size:
        raise PlainDataError("truncated plain data")
    (size,) = _HEADER.unpack(data[:_HEADER.size])
    if size > len(data) - _HEADER.size:
        raise PlainDataError("truncated plain data header")
    try:
        tree = json.loads(bytes(data[_HEADER.size:_HEADER.size + size]))
    except (ValueError, RecursionError) as exc:
        raise PlainDataError(f"malformed plain data: {exc}") from None
    body = data[_HEADER.size + size:]
    dtypes = _dtypes()

    def blob(start, length):
        if not (isinstance(start, int) and isinstance(length, int) and 0 <= start
                and 0 <= length and start + length <= len(body)):
            raise PlainDataError("a buffer descriptor points outside the data")
        return body[start:start + length]

    def dec(x, depth):
        if depth > _MAX_DEPTH:
            raise PlainDataError("plain data nested too deep")
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [dec(v, depth + 1) for v in x]
        if not (isinstance(x, dict) and len(x) == 1):
            raise PlainDataError("malformed plain data")
        (kind, v), = x.items()
        if kind == "tuple" and isinstance(v, list):
            return tuple(dec(i, depth + 1) for i in v)
        if kind == "dict" and isinstance(v, list) and all(
                isinstance(p, list) and len(p) == 2 and type(p[0]) in (str, int) for p in v):
            return {p[0]: dec(p[1], depth + 1) for p in v}
        if kind == "int" and isinstance(v, str):
            return int(v)
        if kind == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
        if kind == "bytes" and isinstance(v, list) and len(v) == 2:
            return bytes(blob(*v))
        if kind == "dtype" and v in dtypes:
            return dtypes[v]
        if kind == "tensor" and isinstance(v, list) and len(v) == 4 and v[0] in dtypes:
            name, shape, start, length = v
            if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
                raise PlainDataError("malformed tensor shape")
            dtype = dtypes[name]
            numel = math.prod(shape)
            if numel * torch.empty((), dtype=dtype).element_size() != length:
                raise PlainDataError("a tensor's size does not match its shape")
            if not numel:
                return torch.empty(shape, dtype=dtype)
            raw = torch.frombuffer(bytearray(blob(start, length)), dtype=torch.uint8)
            return raw.view(dtype).reshape(shape)
        raise PlainDataError(f"malformed plain data ({kind!r})")

    return dec(tree, 0)
