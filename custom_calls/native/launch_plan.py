"""Launch plans: everything the native launcher needs to run one kernel, as plain data.

A plan names the cubin, grid/block/cluster/shared memory, the kernel's argument list and the TMA
descriptors. Descriptors refer to the custom call's buffers by operand index (inputs first, then
outputs); the native handler encodes them with the buffers' *current* addresses at every launch, so
no descriptor can go stale when XLA moves a buffer. Plans are built and checked in pure Python, so
their geometry is unit-tested without a GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# CUtensorMapDataType values (cuda.h).
TMA_UINT8 = 0
TMA_INT32 = 3
TMA_FLOAT32 = 7
TMA_BFLOAT16 = 9
TMA_TFLOAT32 = 11
TMA_16U4_ALIGN8B = 13
TMA_16U4_ALIGN16B = 14
TMA_ELEM_BYTES = {TMA_UINT8: 1, TMA_INT32: 4, TMA_FLOAT32: 4, TMA_BFLOAT16: 2, TMA_TFLOAT32: 4}
_TMA_4BIT = (TMA_16U4_ALIGN8B, TMA_16U4_ALIGN16B)  # dims count 4-bit elements, two per byte
_SWIZZLE_ENUM = {0: 0, 16: 0, 32: 1, 64: 2, 128: 3}

# ARG_SYM_BUFFER: DeepGEMM's one-rank `layout::SymBuffer` by value, its base the operand's address.
ARG_PTR, ARG_U32, ARG_TMAP, ARG_NULL, ARG_BYTES, ARG_SYM_BUFFER = 0, 1, 2, 3, 4, 5
TMAP_WORDS = 19
MAX_RANK = 5


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One cuTensorMapEncodeTiled call. dims/box innermost first, in elements; strides in bytes."""

    operand: int
    dtype: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int  # bytes: 0 (none), 32, 64 or 128
    offset: int = 0  # bytes from the operand's address to the map's base (a region of one buffer)

    def check(self) -> None:
        rank = len(self.dims)
        if not (1 <= rank <= MAX_RANK and len(self.box) == rank and len(self.strides) == rank - 1):
            raise ValueError(f"tensor map rank mismatch: dims {self.dims} strides {self.strides} box {self.box}")
        if any(d <= 0 for d in self.dims) or any(not 0 < b <= 256 for b in self.box):
            raise ValueError(f"tensor map dims {self.dims} must be > 0 and box {self.box} in [1, 256]")
        if any(s % 16 or s <= 0 or s >= 1 << 40 for s in self.strides):
            raise ValueError(f"tensor map strides {self.strides} must be positive multiples of 16 bytes")
        if self.offset < 0 or self.offset % 16:
            raise ValueError(f"tensor map offset {self.offset} must be a non-negative multiple of 16 bytes")
        if self.swizzle not in _SWIZZLE_ENUM:
            raise ValueError(f"swizzle {self.swizzle} not in {sorted(_SWIZZLE_ENUM)}")
        if self.dtype not in TMA_ELEM_BYTES and self.dtype not in _TMA_4BIT:
            raise ValueError(f"tensor map dtype {self.dtype} is not one this host emits")
        esize = TMA_ELEM_BYTES.get(self.dtype)
        if esize is not None and self.swizzle >= 32 and self.box[0] * esize > self.swizzle:
            raise ValueError(f"swizzled box inner {self.box[0]}x{esize} B exceeds the {self.swizzle} B swizzle")
        if esize is not None and self.box[0] * esize % 16:
            raise ValueError(f"box inner {self.box[0]}x{esize} B is not a multiple of 16 B (TMA rule)")

    def extent_bytes(self) -> int:
        """Bytes from the base address to one past the last element the map can address."""
        inner = -(-self.dims[0] // 2) if self.dtype in _TMA_4BIT else self.dims[0] * TMA_ELEM_BYTES[self.dtype]
        return inner + sum((d - 1) * s for d, s in zip(self.dims[1:], self.strides))

    def words(self) -> list[int]:
        rank = len(self.dims)
        pad = lambda t, n, fill: list(t) + [fill] * (n - len(t))  # noqa: E731
        return [self.operand, self.offset, self.dtype, rank, *pad(self.dims, 5, 1), *pad(self.strides, 4, 0),
                *pad(self.box, 5, 1), _SWIZZLE_ENUM[self.swizzle]]


@dataclasses.dataclass(frozen=True)
class KernelArg:
    kind: int  # ARG_*
    value: int = 0  # operand index (ARG_PTR, ARG_SYM_BUFFER), value (ARG_U32), map index (ARG_TMAP)
    data: bytes = b""  # ARG_BYTES: a by-value struct
    offset: int = 0  # ARG_PTR: bytes past the operand's address


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    kernel: str
    cubin: str
    grid: int
    block: int
    cluster: int
    smem: int
    args: tuple[KernelArg, ...]
    tmaps: tuple[TensorMap, ...]
    # all blocks resident at once (the driver fails the launch otherwise): kernels with grid barriers
    cooperative: bool = False
    # programmatic dependent launch: the kernel may be scheduled while the previous kernel on the
    # stream is still running; only for kernels compiled to wait (griddepcontrol.wait) before they
    # read anything a previous kernel wrote
    programmatic: bool = False
    grid_yz: tuple[int, int] = (1, 1)  # the grid's y and z extents (Triton kernels' 3-D grids)

    def check(self) -> None:
        if self.cluster not in (1, 2):
            raise ValueError(f"cluster must be 1 or 2, got {self.cluster}")
        if self.grid <= 0 or self.grid % self.cluster:
            raise ValueError(f"grid {self.grid} must be a positive multiple of the cluster size {self.cluster}")
        if len(self.grid_yz) != 2 or any(not 0 < g < 1 << 16 for g in self.grid_yz):
            raise ValueError(f"grid_yz {self.grid_yz} must be two extents in [1, 65535]")
        if self.block <= 0 or self.smem < 0:
            raise ValueError(f"block {self.block} must be > 0 and smem {self.smem} >= 0")
        for t in self.tmaps:
            t.check()
        for a in self.args:
            if a.kind == ARG_TMAP and not 0 <= a.value < len(self.tmaps):
                raise ValueError(f"argument refers to tensor map {a.value} of {len(self.tmaps)}")

    def check_operands(self, nbytes: tuple[int, ...]) -> None:
        """Every tensor map must stay inside its operand (``nbytes``: size of each operand in bytes,
        inputs then outputs); a map larger than its buffer would let the kernel touch other memory."""
        for i, t in enumerate(self.tmaps):
            if not 0 <= t.operand < len(nbytes):
                raise ValueError(f"{self.kernel}: tensor map {i} refers to operand {t.operand} of {len(nbytes)}")
            if t.offset + t.extent_bytes() > nbytes[t.operand]:
                raise ValueError(f"{self.kernel}: tensor map {i} (dims {t.dims}, strides {t.strides}) spans "
                                 f"{t.extent_bytes()} bytes past offset {t.offset}, operand {t.operand} holds "
                                 f"{nbytes[t.operand]}")
        for a in self.args:
            if a.kind in (ARG_PTR, ARG_SYM_BUFFER) and not 0 <= a.value < len(nbytes):
                raise ValueError(f"{self.kernel}: pointer argument refers to operand {a.value} of {len(nbytes)}")
            if a.kind == ARG_PTR and not 0 <= a.offset < max(nbytes[a.value], 1):
                raise ValueError(f"{self.kernel}: pointer offset {a.offset} outside operand {a.value} "
                                 f"of {nbytes[a.value]} bytes")

    def remap(self, operands: tuple[int, ...]) -> "LaunchPlan":
        """The same launch with operand i of this plan read from operand ``operands[i]`` of the
        custom call (several plans in one call share its operand list)."""
        def at(i: int) -> int:
            if not 0 <= i < len(operands):
                raise ValueError(f"{self.kernel}: operand {i} has no place in the call's {len(operands)} operands")
            return operands[i]

        args = tuple(dataclasses.replace(a, value=at(a.value)) if a.kind in (ARG_PTR, ARG_SYM_BUFFER) else a
                     for a in self.args)
        tmaps = tuple(dataclasses.replace(t, operand=at(t.operand)) for t in self.tmaps)
        return dataclasses.replace(self, args=args, tmaps=tmaps)


def sequence_attributes(plans: tuple[LaunchPlan, ...]) -> dict:
    """Static attributes of one custom call that launches ``plans`` in order on its stream (their
    operand indices refer to the call's operands: inputs, then outputs). Per kernel: its cubin path
    (one per line), 8 launch words (grid x, block, cluster, smem, cooperative, programmatic, grid y,
    grid z), its argument and tensor-map counts; the argument triples and tensor maps follow each
    other in plan order (a tensor-map argument indexes its own plan's maps), by-value arguments
    share one blob."""
    if not plans:
        raise ValueError("a launch sequence needs at least one plan")
    launch, counts, args, tmaps, blob = [], [], [], [], bytearray()
    for plan in plans:
        plan.check()
        if "\n" in plan.cubin:
            raise ValueError(f"{plan.kernel}: a cubin path may not hold a newline, got {plan.cubin!r}")
        launch += [plan.grid, plan.block, plan.cluster, plan.smem, int(plan.cooperative), int(plan.programmatic),
                   *plan.grid_yz]
        counts += [len(plan.args), len(plan.tmaps)]
        for a in plan.args:
            if a.kind == ARG_BYTES:
                args += [ARG_BYTES, len(blob), len(a.data)]
                blob += a.data + b"\0" * (-len(a.data) % 8)
            else:
                args += [a.kind, a.value, a.offset]
        tmaps += [w for t in plan.tmaps for w in t.words()]
    return {
        "cubin": "\n".join(p.cubin for p in plans),
        "launch": np.array(launch, np.int64),
        "counts": np.array(counts, np.int64),
        "args": np.array(args or [0], np.int64),
        "tmaps": np.array(tmaps or [0], np.int64),
        "blob": np.frombuffer(bytes(blob) or b"\0" * 8, np.int64).copy(),
    }


def _ptr(i: int, offset: int = 0) -> KernelArg:
    return KernelArg(ARG_PTR, i, offset=offset)


def _u32(v: int) -> KernelArg:
    if not 0 <= v < 1 << 32:
        raise ValueError(f"kernel argument {v} does not fit in uint32")
    return KernelArg(ARG_U32, v)


def _tmap(i: int) -> KernelArg:
    return KernelArg(ARG_TMAP, i)


NULL = KernelArg(ARG_NULL)
