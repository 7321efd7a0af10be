"""ZeroMQ plumbing shared by the EngineCore and its frontends: addresses, socket options, and
multipart send/receive without pyzmq's per-frame flag arithmetic.

pyzmq's ``send_multipart`` combines ``zmq.SNDMORE | flags`` for every frame; both are
``enum.Flag`` members, and each ``|`` builds a new enum value in Python (about 6 % of a busy
frontend's time, measured with py-spy). ``send_frames`` / ``recv_frames`` use plain ints.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import zmq

# ZMTP-level heartbeats: a peer that stops answering (host gone, network cut) drops the
# connection, which the engine treats like the frontend leaving.
_ZMTP_HEARTBEAT_MS = 1000
_ZMTP_HEARTBEAT_TIMEOUT_MS = 10_000

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)


def normalize_address(address: str) -> str:
    """A ZeroMQ endpoint from what a user typed: ``5555`` and ``:5555`` mean
    ``tcp://127.0.0.1:5555``; ``tcp://:5555`` binds loopback too (only an explicit host, ``*``
    included, binds anything else); ``ipc://`` and ``tcp://`` pass through."""
    address = address.strip()
    if address.isdigit():
        return f"tcp://127.0.0.1:{address}"
    if address.startswith(":") and address[1:].isdigit():
        return f"tcp://127.0.0.1{address}"
    if address.startswith("tcp://:"):
        return "tcp://127.0.0.1" + address[len("tcp://"):]
    if not address.startswith(("tcp://", "ipc://")):
        raise ValueError(f"unsupported address {address!r}: use tcp://HOST:PORT, ipc://PATH or "
                         "a port number")
    return address


def bind(sock: zmq.Socket, address: str) -> str:
    """Bind ``sock`` (port ``0`` or ``*`` picks a free port); returns the bound endpoint."""
    address = normalize_address(address)
    if address.startswith("tcp://") and address.rsplit(":", 1)[1] in ("0", "*"):
        address = address.rsplit(":", 1)[0] + ":*"
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def tcp_host(address: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint (None for other transports)."""
    if not address.startswith("tcp://"):
        return None
    return address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def is_loopback(host: str) -> bool:
    """Whether a frontend connecting to ``host`` reaches an engine on this machine through
    loopback (wildcard hosts included), so the frontend's own sockets can stay on 127.0.0.1."""
    if host in ("localhost", "*", "0.0.0.0", "::", "::1"):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def tune_socket(sock: zmq.Socket) -> None:
    """Options every engine/frontend data socket gets: never drop or block on a high-water mark
    (a request's outputs are bounded by the request itself), close without waiting."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, _ZMTP_HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ZMTP_HEARTBEAT_TIMEOUT_MS)


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0,
                copy: bool = True) -> None:
    """``sock.send_multipart(frames, flags)`` with int flags (see the module docstring)."""
    more = flags | _SNDMORE
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, more if i < last else flags, copy=copy)


def recv_frames(sock: zmq.Socket, flags: int = 0, copy: bool = True) -> list[Any]:
    """``sock.recv_multipart(flags)`` with int flags; raises ``zmq.Again`` if nothing waits."""
    frames = [sock.recv(flags, copy=copy)]
    while sock.getsockopt(_RCVMORE):
        frames.append(sock.recv(flags, copy=copy))
    return frames
