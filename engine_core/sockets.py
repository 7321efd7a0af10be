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

# TCP keepalive, not ZMTP heartbeats: a peer whose host is gone or cut off stops answering the
# probes (about 10 s: 2 s idle, then 8 probes a second apart) and its connection drops, which
# the engine treats like the frontend leaving. A peer process that is merely stopped (SIGSTOP,
# a debugger) keeps its connections, because its kernel answers the probes; a ZMTP heartbeat
# needs the process itself, so a 10 s pause used to drop a healthy peer when it resumed. A
# peer process that dies has its sockets closed by the kernel: noticed at once either way.
_KEEPALIVE_IDLE_S = 2
_KEEPALIVE_INTERVAL_S = 1
_KEEPALIVE_PROBES = 8

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
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, _KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, _KEEPALIVE_INTERVAL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, _KEEPALIVE_PROBES)


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
