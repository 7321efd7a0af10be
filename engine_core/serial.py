"""msgpack (msgspec) serialisation for the sockets: a struct in, a list of frames out.

Frame 0 is the msgpack encoding of the message. numpy arrays are not msgpack types, so they are
encoded as an extension:

* ``EXT_ARRAY_INLINE``: ``(dtype, shape, raw bytes)`` inside frame 0, for arrays smaller than
  ``oob_threshold`` bytes (copying a few hundred bytes is cheaper than a frame of their own);
* ``EXT_ARRAY_OOB``: ``(dtype, shape, frame index)``; the array's own memory is appended to the
  frame list as is (no copy on encode) and the decoder wraps the received frame in an array (no
  copy on decode). Such arrays are read-only views of the received message.

Only plain numeric/bool dtypes are accepted, and nothing is ever unpickled: a peer can at worst
send a message that fails to decode. Every decoding failure raises ``SerialDecodeError`` (a
ValueError); callers log it and drop the message.

An ``Encoder``/``Decoder`` keeps per-call state, so each thread uses its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

T = TypeVar("T")

EXT_ARRAY_INLINE = 1
EXT_ARRAY_OOB = 2
DEFAULT_OOB_THRESHOLD = 256

# Buffers the encoder returns and the decoder accepts (zmq.Frame objects are read through their
# ``.buffer``).
Frame = bytes | bytearray | memoryview

_ALLOWED_KINDS = frozenset("biufc")  # bool, int, uint, float, complex


class SerialDecodeError(ValueError):
    """A message could not be decoded (garbage, wrong type, invalid field, bad array frame)."""


class _ArrayHeader(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    shape: tuple[int, ...]
    data: bytes | int  # the raw bytes (inline) or the index of the frame holding them (OOB)


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_ArrayHeader)


class Encoder:
    """Encodes any msgspec-encodable object, numpy arrays included, into frames."""

    def __init__(self, oob_threshold: int = DEFAULT_OOB_THRESHOLD) -> None:
        self.oob_threshold = oob_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Frame] | None = None

    def encode(self, obj: Any) -> list[Frame]:
        """Frame 0 is the message; any further frames are array buffers (not copies: keep the
        arrays unchanged until the frames are sent)."""
        frames: list[Frame] = [b""]
        self._frames = frames
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._frames = None
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._encode_array(obj)
        if isinstance(obj, np.generic) and obj.dtype.kind in _ALLOWED_KINDS:
            return obj.item()  # a numpy scalar travels as the Python number it holds
        raise NotImplementedError(f"cannot serialise a {type(obj).__name__} (no pickle here)")

    def _encode_array(self, arr: np.ndarray) -> msgspec.msgpack.Ext:
        if arr.dtype.kind not in _ALLOWED_KINDS:
            raise TypeError(f"cannot serialise an array of dtype {arr.dtype}")
        shape = arr.shape  # (ascontiguousarray turns a 0-d array into a 1-d one)
        arr = np.ascontiguousarray(arr)
        dtype = arr.dtype.str  # explicit byte order, e.g. "<f4"
        if arr.nbytes >= self.oob_threshold and self._frames is not None:
            self._frames.append(arr.reshape(-1).view(np.uint8).data)
            header = _ArrayHeader(dtype, shape, len(self._frames) - 1)
            return msgspec.msgpack.Ext(EXT_ARRAY_OOB, _header_encoder.encode(header))
        header = _ArrayHeader(dtype, shape, arr.tobytes())
        return msgspec.msgpack.Ext(EXT_ARRAY_INLINE, _header_encoder.encode(header))


class Decoder(Generic[T]):
    """Decodes frames made by ``Encoder`` into ``type_`` (a struct, a union of tagged structs,
    or ``Any``), validating as it goes."""

    def __init__(self, type_: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook,
                                                dec_hook=self._dec_hook)
        self._frames: Sequence[Any] = ()

    def decode(self, frames: Sequence[Any]) -> T:
        if not frames:
            raise SerialDecodeError("empty message")
        self._frames = frames
        try:
            return self._decoder.decode(_buffer(frames[0]))
        except SerialDecodeError:
            raise
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            # msgspec.ValidationError is a DecodeError; a struct's __post_init__ raising a
            # ValueError (e.g. SamplingParams out of range) arrives as one too.
            raise SerialDecodeError(str(exc)) from exc
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (EXT_ARRAY_INLINE, EXT_ARRAY_OOB):
            raise SerialDecodeError(f"unknown msgpack extension type {code}")
        try:
            header = _header_decoder.decode(data)
            dtype = np.dtype(header.dtype)
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            raise SerialDecodeError(f"bad array header: {exc}") from exc
        if dtype.kind not in _ALLOWED_KINDS or dtype.hasobject:
            raise SerialDecodeError(f"arrays of dtype {dtype} are not accepted")
        if any(d < 0 for d in header.shape):
            raise SerialDecodeError(f"bad array shape {header.shape}")
        if isinstance(header.data, int):
            if code != EXT_ARRAY_OOB or not 0 < header.data < len(self._frames):
                raise SerialDecodeError(f"array frame {header.data} is not part of the message "
                                        f"({len(self._frames)} frames)")
            buf = _buffer(self._frames[header.data])
        else:
            buf = header.data
        nbytes = math.prod(header.shape) * dtype.itemsize
        got = memoryview(buf).nbytes
        if got != nbytes:
            raise SerialDecodeError(f"array of shape {header.shape} and dtype {dtype} needs "
                                    f"{nbytes} bytes, got {got}")
        return np.frombuffer(buf, dtype=dtype).reshape(header.shape)

    @staticmethod
    def _dec_hook(type_: type, obj: Any) -> Any:
        if type_ is np.ndarray and isinstance(obj, np.ndarray):
            return obj
        raise TypeError(f"expected {getattr(type_, '__name__', type_)}, got "
                        f"{type(obj).__name__}")


def _buffer(frame: Any) -> Frame:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return frame if buf is None else buf
