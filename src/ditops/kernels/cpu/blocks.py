"""What the blocked CPU kernels share: per-thread scratch blocks, a LayerNorm on row blocks
that does not depend on the allocator's mood, and the walk over a modulated call's rows.

The exact kernels run eager ATen ops on blocks of rows small enough to stay in cache.
Every temporary such a loop allocates is a malloc of a block's size (1-2 MiB). glibc
serves those from the heap, reusing the memory just freed, only once its mmap threshold
has grown past them (it starts at 128 KiB and grows after large frees); with the
threshold fixed at its starting value (``MALLOC_MMAP_THRESHOLD_=131072``, or a program
that sets it) each one is a fresh ``mmap``: a page fault per 4 KiB and a ``munmap`` per
block, which made the exact FP32LayerNorm as slow as the meaning (field notes, "glibc
malloc and blocked CPU kernels"). So:

* The kernels' own temporaries live in :func:`scratch` blocks: per thread, allocated
  once, reused by every later call (at most ``_MAX_SLOTS`` blocks of a kernel's block
  size, 5 MiB with the modulation kernels' 2 MiB blocks), freed when the thread ends
  or by :func:`release`.
* The one temporary ATen allocates itself is LayerNorm's output: ``native_layer_norm``
  has no real ``out=`` kernel (its ``.out`` overload is generated: it allocates and
  copies). :func:`layer_norm_into` / :func:`layer_norm_rows` therefore run it either
  once per block (when the allocator recycles memory, the fewest calls) or on pieces of
  at most :data:`PIECE_BYTES`, which glibc serves from the heap whatever its threshold.
  Which one is decided once per call by :func:`fresh_pages`, a probe of whether a new
  block-sized allocation comes on pages never touched. Both give the same bits:
  LayerNorm normalises each row on its own.
* :func:`walk_rows` cuts a modulated call into blocks of rows that share their
  modulation rows, for both chains' kernels (:mod:`ditops.kernels.cpu.modulation`,
  Wan's, and :mod:`ditops.kernels.cpu.adaln`, FLUX's): activations ``[B, L, C]``,
  modulations None, 0-d or ``[Bm, G, C]`` views (token ``l`` uses row ``l // (L // G)``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: LayerNorm pieces whose output is at most this big come from malloc's heap even with
#: glibc's mmap threshold at its starting value (128 KiB), with room left for the
#: allocator's header and the 64-byte alignment PyTorch asks for.
PIECE_BYTES = 120 * 1024

#: Calls with fewer blocks keep one LayerNorm call per block without probing.
_MIN_BLOCKS = 4

#: Scratch slots a kernel may hold per thread (0 and 1 fp32 blocks, 2 a low-precision one).
_MAX_SLOTS = 3

_PAGE = mmap.PAGESIZE
#: maps mincore's per-page byte to its "resident" bit
_RESIDENT_BIT = bytes(b & 1 for b in range(256))


# --- the page probe ---------------------------------------------------------------------


@functools.cache
def _mincore() -> Callable[..., int] | None:
    """libc's ``mincore`` (Linux, macOS), or None where there is none."""
    if not sys.platform.startswith(("linux", "darwin")):
        return None
    try:
        fn = ctypes.CDLL(None).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fn.restype = ctypes.c_int
    return fn


def fresh_pages(nbytes: int) -> bool:
    """Whether a new CPU tensor of ``nbytes`` comes on pages never touched.

    True means the allocator hands out fresh memory for this size (glibc with a fixed
    mmap threshold below it, or a heap that just grew): every such temporary costs page
    faults. False when its pages are resident (a recycled chunk) or when it cannot be
    told (no ``mincore``): then the caller keeps its one-call-per-block plan. The probe
    is touched when found fresh, so an allocator that does recycle answers False from
    the next call on; a non-recycling one pays that one block of faults per call.
    """
    mincore = _mincore()
    if mincore is None:
        return False
    probe = torch.empty(nbytes, dtype=torch.uint8)
    addr = probe.data_ptr()
    first = -(-addr // _PAGE) * _PAGE
    pages = (addr + nbytes) // _PAGE - first // _PAGE
    if pages <= 0:
        return False
    vec = ctypes.create_string_buffer(pages)
    if mincore(first, pages * _PAGE, vec) != 0:
        return False
    resident = vec.raw.translate(_RESIDENT_BIT).count(1)
    if 2 * resident >= pages:
        return False
    probe.zero_()
    return True


def piece_rows(rows: int, block_rows: int, row_bytes: int) -> int:
    """Rows per LayerNorm call for a call of ``rows`` rows in blocks of ``block_rows``,
    LayerNorm's output rows taking ``row_bytes``.

    ``block_rows`` (one call per block) unless a block-sized output would come on fresh
    pages, a piece of :data:`PIECE_BYTES` holds at least one row, and the call has at
    least :data:`_MIN_BLOCKS` blocks (the probe may cost one block's faults itself).
    """
    nbytes = block_rows * row_bytes
    if nbytes <= PIECE_BYTES or row_bytes > PIECE_BYTES or rows < _MIN_BLOCKS * block_rows:
        return block_rows
    if not fresh_pages(nbytes):
        return block_rows
    return PIECE_BYTES // row_bytes


def block_step(step: int, piece: int) -> int:
    """``step`` rounded down to whole pieces (no ragged piece inside a block)."""
    return step if piece >= step else step // piece * piece


# --- LayerNorm on a block of rows ---------------------------------------------------------


def layer_norm_into(
    dst: torch.Tensor,
    src: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    piece: int,
) -> None:
    """``dst.copy_(layer_norm(src))`` over the last dim of 2-D ``src``, ``piece`` rows per
    call; ``dst`` may be ``src`` itself or of another dtype (``copy_`` rounds as ``.to``)."""
    shape = (src.shape[-1],)
    if piece >= src.shape[0]:
        dst.copy_(torch.layer_norm(src, shape, weight, bias, eps))
        return
    for s, d in zip(src.split(piece), dst.split(piece), strict=True):
        d.copy_(torch.layer_norm(s, shape, weight, bias, eps))


def layer_norm_rows(
    src: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    piece: int,
    work: torch.Tensor,
) -> torch.Tensor:
    """``layer_norm(src)``: ATen's own output when ``piece`` covers the block (no copy),
    else written piece by piece into ``work`` (same shape and dtype; may be ``src``)."""
    if piece >= src.shape[0]:
        return torch.layer_norm(src, (src.shape[-1],), weight, bias, eps)
    layer_norm_into(work, src, weight, bias, eps, piece)
    return work


# --- the kernels' intra-op threads ---------------------------------------------------------

#: Intra-op threads the blocked kernels run with (None: the process's). See
#: :func:`kernel_threads`.
THREADS: int | None = 1


@functools.cache
def _omp() -> Any:
    """torch's own OpenMP runtime (its ``lib/libgomp.so.1``), or None (another build)."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if not os.path.exists(path):
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
        lib.omp_get_max_threads.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


@contextlib.contextmanager
def kernel_threads(n: int | None = None) -> Iterator[None]:
    """The calling thread's intra-op threads set to ``n`` (default :data:`THREADS`) inside
    the block, restored after; other threads are not affected.

    Why one thread per block: a blocked kernel is a chain of small ATen calls, each an
    OpenMP parallel region ending in a barrier. On a machine whose cores are shared
    (another process busy), each barrier waits for a descheduled worker, a scheduler
    slice at worst, dozens of times per call. Measured on a 2-core EPYC at load 10-12
    (``benchmarks/cpu/busy_neighbour.txt``): with two threads the exact kernels ran at
    0.1-0.6x their meaning, with one at 2.4-8x (Wan's chain) and 1.2-3.5x (FLUX's). The
    cores are used by handing whole blocks to threads instead
    (:mod:`ditops.kernels.cpu.workers`), which waits on nobody. Set per thread through
    torch's OpenMP runtime (``omp_set_num_threads`` sets the calling thread's value), not
    ``torch.set_num_threads``, which also changes the default of threads started later.
    Where that runtime is not found, nothing changes.
    """
    n = THREADS if n is None else n
    lib = _omp() if n is not None else None
    if lib is None:
        yield
        return
    torch.get_num_threads()  # torch sets a thread's OpenMP value on first use: do it first
    old = lib.omp_get_max_threads()
    if old == n:
        yield
        return
    lib.omp_set_num_threads(n)
    try:
        yield
    finally:
        lib.omp_set_num_threads(old)


# --- per-thread scratch ----------------------------------------------------------------


class _Pool(threading.local):
    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.busy = False


_pool = _Pool()


class Scratch:
    """Scratch blocks for one kernel call: ``take(slot, rows, cols, dtype)``."""

    def __init__(self, buffers: dict[int, torch.Tensor]) -> None:
        self._buffers = buffers

    def take(self, slot: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``[rows, cols]`` tensor of ``dtype`` in ``slot`` (contents undefined).

        The memory is kept for later calls; it grows to the largest request and no
        further. Never return it (or a view of it) to a caller.
        """
        if not 0 <= slot < _MAX_SLOTS:
            raise ValueError(f"scratch slot {slot} out of range [0, {_MAX_SLOTS})")
        nbytes = rows * cols * dtype.itemsize
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            self._buffers.pop(slot, None)  # free the old one first
            # A normal tensor, so later calls may use it in and out of inference mode.
            with torch.inference_mode(False):
                buf = torch.empty(nbytes, dtype=torch.uint8)
            self._buffers[slot] = buf
        return buf[:nbytes].view(dtype).view(rows, cols)


@contextlib.contextmanager
def scratch() -> Iterator[Scratch]:
    """This thread's scratch for one kernel call's loop over blocks, under
    ``torch.no_grad()`` and :func:`kernel_threads`.

    A call made while another holds the thread's scratch (a kernel run from a hook
    inside a kernel) gets blocks of its own, freed at its end.
    """
    if _pool.busy:
        with torch.no_grad(), kernel_threads():
            yield Scratch({})
        return
    _pool.busy = True
    try:
        with torch.no_grad(), kernel_threads():
            yield Scratch(_pool.buffers)
    finally:
        _pool.busy = False


def release() -> None:
    """Free the calling thread's scratch blocks (they are made again when next needed)."""
    _pool.buffers.clear()


def held_bytes() -> int:
    """Bytes of scratch the calling thread holds."""
    return sum(b.numel() for b in _pool.buffers.values())


# --- walking the rows of a modulated call ----------------------------------------------


def _groups(*mods: torch.Tensor | None) -> int:
    """The common row count G of the 3-D modulations (1 when none is per frame/token)."""
    g = 1
    for m in mods:
        if m is not None and m.dim() == 3 and m.shape[1] > 1:
            g = m.shape[1]
    return g


def per_token(m: torch.Tensor | None, L: int) -> bool:
    """A ``[Bm, L, C]`` modulation: one row per token."""
    return m is not None and m.dim() == 3 and m.shape[1] == L and L > 1


Rows = dict[str, torch.Tensor | None]
#: One block of :func:`walk_rows`: ``(b, g, l0, l1, rows)``.
Block = tuple[int, int, int, int, Rows]


def walk_rows(B: int, L: int, step: int, mods: Rows) -> Iterator[Block]:
    """The row blocks of a call: ``(b, g, l0, l1, rows)``.

    Rows ``l0:l1`` of sample ``b`` all lie in group ``g`` (a frame; 0 without per-frame
    modulation) and use the modulation rows ``rows[name]``: 0-d (a scalar), ``[C]`` or,
    per token, ``[l1 - l0, C]``. Views are made once per (sample, group) where they can
    be: the Python work per block is a few slices.
    """
    G = _groups(*mods.values())
    seg = L if G in (1, L) else L // G
    for b in range(B):
        for g, s0 in enumerate(range(0, L, seg)):
            fixed: Rows = {}
            token: dict[str, torch.Tensor] = {}
            for name, m in mods.items():
                if m is None or m.dim() == 0:
                    fixed[name] = m
                    continue
                mb = m[b if m.shape[0] > 1 else 0]
                if per_token(m, L):
                    token[name] = mb
                else:
                    fixed[name] = mb[0 if m.shape[1] == 1 else g]
            s1 = min(s0 + seg, L)
            for l0 in range(s0, s1, step):
                l1 = min(l0 + step, s1)
                rows = dict(fixed)
                for name, mb in token.items():
                    rows[name] = mb[l0:l1]
                yield b, g, l0, l1, rows
