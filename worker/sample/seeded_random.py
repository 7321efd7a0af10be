"""Seeded sampling noise for a batch of rows in one pass: a counter-based hash of (the row's
position key, the column), so every seeded row draws its numbers without a generator of its own.

A torch.Generator per seeded row meant a ``manual_seed`` and an ``exponential_`` launch per row
and step: about 2 ms of host time per step for 256 seeded requests on an H200, which the
engine thread cannot hide once structured outputs put sampling on its critical path. Here the
noise of row r, column c is ``-log(u)`` with ``u`` made of 23 bits of ``hash(key_r, c)``, where
``key_r = position_seed(seed, tokens generated so far)``: a pure function of the request's seed
and position, so a seeded request draws the same numbers whatever the batch around it, after a
preemption, and on any device. This module is the torch implementation (the reference of
``triton_sampling.seeded_exponential_``), written in int64 with explicit 32-bit wrap so CPU and
GPU compute the same bits; on a CPU the hash itself runs in numpy uint32 (``column_hash_np``:
the same bits, about 5 times faster).
"""

from __future__ import annotations

import numpy as np
import torch

_SEED_MIX = 0x9E3779B97F4A7C15
_INT63 = (1 << 63) - 1
_M32 = 0xFFFFFFFF
# Constants of the 32-bit mixer (Wellons' "lowbias32") and the stream separators.
MIX_A = 0x7FEB352D
MIX_B = 0x846CA68B
COL_MUL = 0x9E3779B1
SALT_LO = 0x243F6A88
SALT_HI = 0x85A308D3
_ROWS_PER_CHUNK = 16  # bounds the CPU temporaries to 16 x vocabulary int64s


def position_seed(seed: int, position: int) -> int:
    """Key of one sampled position: a pure function of the request's seed and how many tokens
    it has generated."""
    return ((seed ^ ((position + 1) * _SEED_MIX)) & _INT63) or 1


def position_keys(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``position_seed`` of many rows at once (int64); equal to the scalar function."""
    with np.errstate(over="ignore"):
        mixed = (positions.astype(np.uint64) + np.uint64(1)) * np.uint64(_SEED_MIX)
        keys = (seeds.astype(np.uint64) ^ mixed) & np.uint64(_INT63)
    keys = keys.astype(np.int64)
    keys[keys == 0] = 1
    return keys


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32 without int64 overflow (two 16-bit halves of c)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_A)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_B)
    return x ^ (x >> 16)


def row_states(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit words each row's column hash is keyed with (int64 [R] each)."""
    keys = keys.to(torch.int64)
    a = _mix32((keys & _M32) ^ SALT_LO)
    b = _mix32(((keys >> 32) & _M32) ^ SALT_HI ^ a)
    return a, b


def column_hash(a: torch.Tensor, b: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """32-bit hash of each (row, column): int64 [R, n] from row words [R] and columns [n]."""
    h = _mix32(_mul32(cols.to(torch.int64), COL_MUL).unsqueeze(0) ^ a.unsqueeze(1))
    return _mix32((h + b.unsqueeze(1)) & _M32)


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """float32 in [2**-24, 1 - 2**-24] from the top 23 bits of a 32-bit hash, exact in float32
    (with 24 bits, ``+ 0.5`` at the top would round to 1.0, whose noise -log(1) = 0 would
    draw a banned token: p / q = 0 / 0)."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _mix32_np(x: np.ndarray) -> np.ndarray:
    """``_mix32`` in numpy uint32, in place (its products wrap mod 2**32 by themselves)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(MIX_A)
    x ^= x >> np.uint32(15)
    x *= np.uint32(MIX_B)
    x ^= x >> np.uint32(16)
    return x


def column_hash_np(a: np.ndarray, b: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``column_hash`` on the host in uint32 (the same bits, about 4 times faster than the
    int64 torch emulation on a CPU): uint32 [R, n] from row words [R] and columns [n]."""
    with np.errstate(over="ignore"):
        h = (cols.astype(np.uint32) * np.uint32(COL_MUL))[None, :] ^ a.astype(np.uint32)[:, None]
        h = _mix32_np(h)
        h += b.astype(np.uint32)[:, None]
        return _mix32_np(h)


def seeded_exponential(keys: torch.Tensor, n: int) -> torch.Tensor:
    """float32 [R, n]: Exp(1) noise of the rows keyed by ``keys`` (int64 [R])."""
    out = torch.empty((keys.shape[0], n), dtype=torch.float32, device=keys.device)
    cpu = keys.device.type == "cpu"
    cols = torch.arange(n, device=keys.device)
    a, b = row_states(keys)
    if cpu:
        cols_np, a_np, b_np = cols.numpy(), a.numpy(), b.numpy()
    for s in range(0, keys.shape[0], _ROWS_PER_CHUNK):
        e = slice(s, s + _ROWS_PER_CHUNK)
        if cpu:
            h = torch.from_numpy(column_hash_np(a_np[e], b_np[e], cols_np).view(np.int32))
            # (The top 23 bits as uniform_from_hash takes them, from the uint32 bits.)
            u = (((h >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
        else:
            u = uniform_from_hash(column_hash(a[e], b[e], cols))
        out[e] = -torch.log(u)
    return out


def seeded_exponential_(q: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> None:
    """Overwrite rows ``rows`` (int64 [R]) of ``q`` ([B, n] float32) with their seeded noise."""
    if rows.numel():
        q[rows] = seeded_exponential(keys, q.shape[1])
