"""Triton all-reduce for the 16-bit hidden states of decode steps (up to 256 Ki elements), in
which every element is its own ready flag (the buffers are owned by
``distributed/lamport_allreduce.py``).

Each rank has a receive buffer per parity with a row per rank. A row element holds a sentinel
bit pattern, negative zero, until the peer's value for it lands. A rank stores its input into
row ``rank`` of every peer's buffer over NVLink, then polls the peers' rows of its own buffer
until no sentinel is left, sums all rows in rank order in float32 (its own from registers; so
every rank gets the same bits), and puts the sentinel back. A value arriving is its own
signal: no flag, no fence and no barrier, so an all-reduce costs one one-way trip over
NVLink. A one-shot reduction behind a barrier pays a signal round trip and then remote loads.
The same kernel also gathers (``lamport_all_gather``: each rank's row stored, not summed). An
input that is itself negative zero is sent as positive zero; the sum can differ only in the
sign of a zero result.

Buffer reuse: calls alternate between two buffers (per program, from a counter in device
memory, so CUDA graph replays alternate too). Rank A writes buffer ``b`` again two calls later.
By then it has read B's data of the call in between, which B sent after its kernel for the
earlier call, the one that read and re-armed ``b``, had completed. So a write never lands in
an element its owner has not yet consumed, and the owner's re-arm never erases a new value.
Program ``p`` always covers the same ``CHUNK`` elements, so this holds per program whatever
the tensor sizes in between. Every rank must make the same sequence of calls (tensor-parallel
ranks run the same steps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.worker.ops.triton_decode import SENTINEL, launch, pdl_enabled
CHUNK = 512  # elements per program
MAX_PROGRAMS = 512  # so one row holds up to CHUNK * MAX_PROGRAMS elements (64 x 4096)


@triton.jit
def _as_float(bits, BF16: tl.constexpr):
    if BF16:
        return bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _as_bits(x, BF16: tl.constexpr):
    if BF16:
        return x.to(tl.bfloat16).to(tl.int16, bitcast=True)
    return x.to(tl.float16).to(tl.int16, bitcast=True)


@triton.jit(do_not_specialize=["rank"])
def _lamport_all_reduce_kernel(
    x_ptr,  # int16 view of the input
    out_ptr,  # int16 view of the output
    buf_ptrs,  # int64 [WORLD]: every rank's receive buffer
    count_ptr,  # int32 [MAX_PROGRAMS]: calls made so far, per program
    n,
    rank,
    row_stride,  # elements between the rows of one parity
    parity_stride,  # elements between the two parities
    res_ptr,  # int16 view of the residual (ADD_SS)
    ss_ptr,  # float32 [programs]: each chunk's sum of squares (ADD_SS)
    WORLD: tl.constexpr,
    CHUNK: tl.constexpr,
    BF16: tl.constexpr,
    SENT: tl.constexpr,
    PDL: tl.constexpr,
    # out = sum + residual (rounded as the add of fused_add_rms_norm), and each program's sum
    # of its squares to ss_ptr: what the next GEMV needs to norm its input without reading
    # the whole row in every program.
    ADD_SS: tl.constexpr,
    # All-gather instead: out holds WORLD rows of n, row j rank j's input (same buffers and
    # protocol; nothing is summed).
    GATHER: tl.constexpr,
):
    p = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the input comes from the previous kernel
    idx = p * CHUNK + tl.arange(0, CHUNK)
    m = idx < n
    # .cg: the previous call's write must not be shadowed by a stale L1 line.
    calls = tl.load(count_ptr + p, cache_modifier=".cg")
    off = (calls % 2) * parity_stride
    bits = tl.load(x_ptr + idx, mask=m, other=0)
    if ADD_SS:
        # Issued with the input, not after the polling: one memory round trip fewer on the
        # critical path.
        res = tl.load(res_ptr + idx, mask=m, other=0)
    bits = tl.where(bits == SENT, 0, bits)
    for j in tl.static_range(WORLD):
        if j != rank:
            peer = tl.load(buf_ptrs + j).to(tl.pointer_type(tl.int16))
            tl.store(peer + off + rank * row_stride + idx, bits, mask=m)
    # Keeps the stores ahead of the polling below in the compiled code: were they sunk past
    # it, every rank would wait for the others' stores forever.
    tl.debug_barrier()
    mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(tl.int16)) + off
    acc = tl.zeros([CHUNK], tl.float32)
    for j in tl.static_range(WORLD):
        # This rank's own row is never sent through its buffer (that cost two dependent round
        # trips to L2 before the peers' rows were even looked at): its registers hold the same
        # bits the peers receive, so the rank-order sum is the same on every rank.
        if j == rank:
            got = bits
        else:
            src = mine + j * row_stride + idx
            got = tl.load(src, mask=m, other=0, volatile=True)
            while tl.max((got == SENT).to(tl.int32), axis=0) > 0:
                got = tl.load(src, mask=m, other=0, volatile=True)
            tl.store(src, tl.full([CHUNK], SENT, tl.int16), mask=m)  # re-arm: call after next
        if GATHER:
            tl.store(out_ptr + j * n + idx, got, mask=m)
        else:
            acc += _as_float(got, BF16)
    if not GATHER:
        bits = _as_bits(acc, BF16)
        if ADD_SS:
            h = _as_float(bits, BF16) + _as_float(res, BF16)
            bits = _as_bits(h, BF16)
            hf = _as_float(bits, BF16)
            tl.store(ss_ptr + p, tl.sum(hf * hf, axis=0))
        tl.store(out_ptr + idx, bits, mask=m)
    tl.store(count_ptr + p, calls + 1)


def lamport_all_reduce(x: torch.Tensor, out: torch.Tensor, buf_ptrs: torch.Tensor,
                       counts: torch.Tensor, rank: int, world: int, row_elems: int,
                       residual: torch.Tensor | None = None,
                       sum_squares: torch.Tensor | None = None) -> None:
    """``out`` = the sum of ``x`` over the ranks whose receive buffers ``buf_ptrs`` lists (each
    ``[2, world, row_elems]`` int16, filled with ``SENTINEL`` before the first call). ``x``
    and ``out`` are contiguous bfloat16 or float16 tensors of at most ``row_elems`` elements
    and ``CHUNK * MAX_PROGRAMS``; ``counts`` is this rank's ``[MAX_PROGRAMS]`` int32, zero at
    the start.

    With ``residual`` (same shape) ``out`` is the sum plus ``residual``, and ``sum_squares``
    (float32, at least ``cdiv(numel, CHUNK)`` elements) gets each ``CHUNK``'s sum of the
    squares of ``out``: the RMSNorm statistics of a row for ``triton_decode.gemv(norm_ss=)``.
    """
    if x.dtype not in (torch.bfloat16, torch.float16) or out.dtype != x.dtype:
        raise ValueError(f"the signal-free all-reduce moves 16-bit floats, not {x.dtype}")
    n = x.numel()
    add_ss = residual is not None
    if add_ss:
        assert (sum_squares is not None and sum_squares.dtype == torch.float32
                and residual.dtype == x.dtype and residual.is_contiguous()
                and residual.numel() == n and sum_squares.numel() >= triton.cdiv(n, CHUNK))
    _launch(x, out, buf_ptrs, counts, rank, world, row_elems, residual, sum_squares, False)


def lamport_all_gather(x: torch.Tensor, out: torch.Tensor, buf_ptrs: torch.Tensor,
                       counts: torch.Tensor, rank: int, world: int, row_elems: int) -> None:
    """``out`` (``world * x.numel()`` elements) = every rank's ``x``, in rank order, through
    the same buffers and protocol as ``lamport_all_reduce`` (calls of the two may interleave
    as long as every rank makes the same sequence). A negative zero arrives as +0."""
    if x.dtype not in (torch.bfloat16, torch.float16) or out.dtype != x.dtype:
        raise ValueError(f"the signal-free all-gather moves 16-bit floats, not {x.dtype}")
    assert out.numel() == world * x.numel() and out.is_contiguous()
    _launch(x, out, buf_ptrs, counts, rank, world, row_elems, None, None, True)


def _launch(x: torch.Tensor, out: torch.Tensor, buf_ptrs: torch.Tensor, counts: torch.Tensor,
            rank: int, world: int, row_elems: int, residual: torch.Tensor | None,
            sum_squares: torch.Tensor | None, gather: bool) -> None:
    n = x.numel()
    add_ss = residual is not None
    xb = x.view(torch.int16)
    launch(_lamport_all_reduce_kernel, (triton.cdiv(n, CHUNK),),
           (xb, out.view(torch.int16), buf_ptrs, counts, n, rank, row_elems, world * row_elems,
            residual.view(torch.int16) if add_ss else xb, sum_squares if add_ss else counts),
           dict(WORLD=world, CHUNK=CHUNK, BF16=x.dtype == torch.bfloat16, SENT=SENTINEL,
                ADD_SS=add_ss, GATHER=gather, num_warps=2),
           pdl_enabled(x.device))
