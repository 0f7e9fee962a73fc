"""LoRA in the model: per-projection slot buffers and the registered op that applies them.

Every projection an adapter may target (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) gets a :class:`LoRASlots` child (attribute ``lora``) when the engine serves
adapters. It holds ``max_loras`` slots of the adapters' A and B matrices in two persistent
buffers, for every slice of a merged projection (``q``/``k``/``v``, gate/up):

* ``a`` ``[max_loras * num_slices * max_rank, in]``: slot ``l``, slice ``j`` at rows
  ``(l * num_slices + j) * max_rank ...`` (a smaller rank is zero-padded);
* ``b`` ``[max_loras * num_slices * max_rank, out]`` (B transposed): the same rows, the
  slice's output columns only (block-diagonal over the slices), pre-multiplied by the
  adapter's scaling. Both are row-major in the order the products read them, so a slot is a
  contiguous block of rows of each.

``forwardkit::lora_add_(out, x, a, b, token_slots, num_slots)`` adds ``(x @ A_s.T) @ B_s.T`` to
each row of ``out`` for the slot ``s = token_slots[row]`` (-1: no adapter), in place. It is one
opaque node in compiled graphs, so loading an adapter into a slot is a copy into the buffers:
nothing recompiles. ``token_slots`` is one persistent int64 buffer shared by every layer (the
runner writes it per step, -1 on padding rows).

Per call the op needs to know which slots the step uses. The runner binds a
:class:`LoRAStepPlan` per step (:func:`bind_plan`: a ``ContextVar``, like the CPU linear
router): none used (a step without adapters: the op returns at once), one slot for every row
(two small matmuls on that slot's rows of the buffers), or a mix (one matmul over all slots,
the per-row slot mask, one matmul back). Without a bound plan (start-up dummy steps, CUDA-graph
captures) the op reads the forward context's ``batch_descriptor.has_lora``: False adds nothing
(the graph of a step without adapters has no LoRA work), True takes the mixed path with the
mask computed on the device from ``token_slots`` (no host read: capturable).

A step without adapters does no LoRA work: eager, :meth:`LoRASlots.add_to` reads the bound plan
and does not even call the op; in a compiled graph the op is a node and returns at once.
:data:`lora_op_counts` counts the op's runs and which path served them (tests read it).

On the CPU the products avoid plain bf16 matmuls, which reorder their weight on every call
(that cost more than the products themselves): where oneDNN packs weights of the slots' dtype
(``kernels/cpu/router.py``'s ``prepack_supported``) the mixed path multiplies by packed copies
of ``a`` and of ``b`` transposed, as ``forwardkit::linear`` does for the base weights (1B shape,
16 rows: 1.8 ms a layer plain, 1.0 ms packed); the one-adapter path of one or two rows runs the
native few-row kernel on the slot's rows of ``a`` and of a per-slot transposed copy of ``b``.
These copies are derived: a slot write drops them and the next call that needs one re-derives
it (once per write, not per step).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from weakref import finalize, ref

import torch
import torch.nn as nn
import torch.nn.functional as F

from forwardkit.forward_context import get_forward_context, is_forward_context_available
from forwardkit.kernels.cpu import native_linear
from forwardkit.kernels.cpu.router import prepack_supported
from forwardkit.layers.linear import Linear, MergedLinear
from forwardkit.layers.parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["LORA_PROJECTIONS", "LoRAOpCounts", "LoRASlice", "LoRASlots", "LoRAStepPlan",
           "attach_lora_slots", "bind_plan", "current_plan", "lora_add_", "lora_op_counts"]


@dataclass
class LoRAOpCounts:
    """Process-wide counts of ``forwardkit::lora_add_``: ``calls`` (the op ran), ``applied``
    (it computed adapter products; the rest returned at once), ``packed`` (mixed products by
    the packed copies), ``native`` (one-adapter products by the native kernel) and ``repacks``
    (derived copies re-made after slot writes). Counted,
    never timed."""

    calls: int = 0
    applied: int = 0
    packed: int = 0
    native: int = 0
    repacks: int = 0


lora_op_counts = LoRAOpCounts()


@dataclass(frozen=True)
class LoRASlice:
    """One slice of a (merged) projection: its shard id (``"q"``, ``0``, ... or None for a plain
    projection), its rows in this rank's output, and which part of the adapter's full tensors
    this rank holds: ``b_rows`` (start, length) of the full B's rows (column-parallel), or
    ``a_cols`` (start, length) of the full A's columns (row-parallel); None = all of it."""

    shard_id: Hashable | None
    out_offset: int
    out_size: int
    full_out_size: int
    b_rows: tuple[int, int] | None = None
    a_cols: tuple[int, int] | None = None


class LoRAStepPlan:
    """The slots one step uses, known on the host: ``slots`` per token (-1 none).

    ``single`` is the slot every row uses (None: no slot, or a mix); ``mask`` (mixed steps
    only) is ``[num_tokens, num_slots, 1]`` ones where a row uses the slot."""

    def __init__(self, token_slots: Sequence[int], num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_tokens = len(token_slots)
        used = sorted({s for s in token_slots if s >= 0})
        self.active = bool(used)
        self.single: int | None = None
        self.mask: torch.Tensor | None = None
        if len(used) == 1 and all(s == used[0] for s in token_slots):
            self.single = used[0]
        elif used:
            index = torch.tensor(token_slots, dtype=torch.long)
            mask = torch.zeros(self.num_tokens, num_slots + 1, 1, dtype=dtype)
            mask[torch.arange(self.num_tokens), index.clamp(min=-1) + 1] = 1  # col 0: none
            self.mask = mask[:, 1:].contiguous().to(device)


_PLAN: ContextVar[LoRAStepPlan | None] = ContextVar("forwardkit_lora_plan", default=None)


@contextmanager
def bind_plan(plan: LoRAStepPlan | None) -> Iterator[None]:
    """Make ``plan`` the one ``forwardkit::lora_add_`` reads until the block ends."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def current_plan() -> LoRAStepPlan | None:
    """The plan bound by :func:`bind_plan`, or None."""
    return _PLAN.get()


def _descriptor_has_lora() -> bool:
    if not is_forward_context_available():
        return True  # outside a step (a direct call): apply whatever token_slots says
    desc = get_forward_context().batch_descriptor
    return desc is None or bool(desc.has_lora)


# The row count oneDNN picks the packed layout for (as the CPU linear router's packed copies).
_PACK_ROWS_HINT = 64


class _DerivedSlots:
    """Copies derived from one :class:`LoRASlots`' buffers for the CPU paths, re-derived at
    their first use after a slot write: oneDNN-packed ``a`` and ``b`` transposed (the mixed
    path, where oneDNN packs the dtype) and ``b`` transposed per slot, ``[slots, out, width]``
    (the native few-row kernel of the one-adapter path reads a slot's rows contiguously)."""

    def __init__(self, slots: LoRASlots, packable: bool) -> None:
        self.slots = ref(slots)
        self.packable = packable
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.slot_bt: torch.Tensor | None = None

    def written(self) -> None:
        """A slot was written: every copy is stale."""
        self.packed = self.slot_bt = None

    def owns(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether ``a`` and ``b`` are still the buffers these copies derive from."""
        slots = self.slots()
        return (slots is not None and slots.a.data_ptr() == a.data_ptr()
                and slots.b.data_ptr() == b.data_ptr() and slots.a.shape == a.shape
                and slots.b.shape == b.shape)

    def packed_copies(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed ``(a, b.T)``."""
        if self.packed is None:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            self.packed = (reorder(a.detach(), _PACK_ROWS_HINT),
                           reorder(b.detach().t().contiguous(), _PACK_ROWS_HINT))
            lora_op_counts.repacks += 1
        return self.packed

    def slot_b_t(self, b: torch.Tensor, num_slots: int, slot: int) -> torch.Tensor:
        """Slot ``slot``'s rows of ``b``, transposed and contiguous: ``[out, width]``."""
        if self.slot_bt is None:
            self.slot_bt = b.detach().view(num_slots, -1, b.shape[1]).transpose(1, 2).contiguous()
            lora_op_counts.repacks += 1
        return self.slot_bt[slot]


# ``a.data_ptr()`` -> derived copies of the CPU slots that own ``a`` (filled by LoRASlots,
# emptied when they are freed)
_PACKED: dict[int, _DerivedSlots] = {}


def _forget_packed(ptr: int, entry: _DerivedSlots) -> None:
    if _PACKED.get(ptr) is entry:
        del _PACKED[ptr]


def _add_mixed(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               mask: torch.Tensor, num_slots: int) -> None:
    n = x.shape[0]
    entry = _PACKED.get(a.data_ptr())
    if entry is not None and entry.packable and x.dtype == a.dtype and entry.owns(a, b):
        packed = entry.packed_copies(a, b)
        linear = torch.ops.mkldnn._linear_pointwise
        shrunk = linear(x, packed[0], None, "none", [], "").view(n, num_slots, -1)
        shrunk.mul_(mask)
        out.add_(linear(shrunk.view(n, -1), packed[1], None, "none", [], ""))
        lora_op_counts.packed += 1
        return
    shrunk = F.linear(x, a).view(n, num_slots, -1)
    shrunk.mul_(mask)
    out.addmm_(shrunk.view(n, -1), b)


def _add_single_native(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       num_slots: int, slot: int) -> bool:
    """Slot ``slot``'s product for a few rows by the native kernel (a decode step of one or
    two requests with one adapter): False when it does not serve them."""
    entry = _PACKED.get(a.data_ptr())
    if entry is None or not entry.owns(a, b) or not x.is_contiguous():
        return False
    width = a.shape[0] // num_slots
    shrunk = native_linear.linear_rows(x, a[slot * width:(slot + 1) * width], None)
    if shrunk is None:
        return False
    delta = native_linear.linear_rows(shrunk, entry.slot_b_t(b, num_slots, slot), None)
    if delta is None:
        return False
    out.add_(delta)
    lora_op_counts.native += 1
    return True


def lora_add_(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              token_slots: torch.Tensor, num_slots: int) -> None:
    """``out[i] += (x[i] @ A_s.T) @ B_s.T`` for ``s = token_slots[i] >= 0`` (module docstring)."""
    lora_op_counts.calls += 1
    n = x.shape[0]
    if n == 0:
        return
    plan = _PLAN.get()
    if plan is not None and plan.num_tokens == n:
        if not plan.active:
            return
        lora_op_counts.applied += 1
        if plan.single is not None:
            width = a.shape[0] // num_slots
            lo = plan.single * width
            if n <= native_linear.MAX_ROWS and _add_single_native(out, x, a, b, num_slots,
                                                                   plan.single):
                return
            shrunk = F.linear(x, a[lo:lo + width])
            out.addmm_(shrunk, b[lo:lo + width])
            return
        assert plan.mask is not None
        _add_mixed(out, x, a, b, plan.mask.to(x.dtype), num_slots)
        return
    if not _descriptor_has_lora():
        return
    lora_op_counts.applied += 1
    slots = token_slots[:n]
    ids = torch.arange(num_slots, device=slots.device)
    mask = (slots.unsqueeze(1) == ids.unsqueeze(0)).to(x.dtype).unsqueeze(-1)
    _add_mixed(out, x, a, b, mask, num_slots)


# Registered with torch.library.Library (like forwardkit::linear): a light call, one per
# projection per step; ``out`` is mutated in place (Inductor keeps the node and reuses out).
_LIB = torch.library.Library("forwardkit", "FRAGMENT")
_LIB.define("lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor token_slots, "
            "int num_slots) -> ()")
_LIB.impl("lora_add_", lora_add_, "CompositeExplicitAutograd")


@torch.library.register_fake("forwardkit::lora_add_", lib=_LIB)
def _(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
      token_slots: torch.Tensor, num_slots: int) -> None:
    return None


class LoRASlots(nn.Module):
    """The adapter slots of one projection (module docstring): buffers ``a``, ``b`` and the
    shared ``token_slots``; :meth:`load` / :meth:`clear` write one slot."""

    a: torch.Tensor
    b: torch.Tensor
    token_slots: torch.Tensor

    def __init__(self, input_size: int, output_size: int, slices: Sequence[LoRASlice],
                 max_loras: int, max_rank: int, dtype: torch.dtype, token_slots: torch.Tensor,
                 full_input_size: int | None = None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.full_input_size = full_input_size if full_input_size is not None else input_size
        self.slices = list(slices)
        self.max_loras, self.max_rank = max_loras, max_rank
        width = max_loras * len(self.slices) * max_rank
        device = token_slots.device
        self.register_buffer("a", torch.zeros(width, input_size, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(width, output_size, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("token_slots", token_slots, persistent=False)
        self._packed: _DerivedSlots | None = None
        if device.type == "cpu":
            self._packed = _DerivedSlots(self, prepack_supported(dtype, device))
            _PACKED[self.a.data_ptr()] = self._packed
            finalize(self, _forget_packed, self.a.data_ptr(), self._packed)

    def _written(self) -> None:
        """After a slot write: the packed copies are re-derived at their next use."""
        if self._packed is not None:
            self._packed.written()

    @property
    def slot_width(self) -> int:
        """Rows of ``a`` and ``b`` one slot holds: slices x max rank."""
        return len(self.slices) * self.max_rank

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Add every row's adapter product to ``out`` (the projection of ``x``), in place. Run
        eagerly in a step whose bound plan has no adapter, it returns without calling the op
        (a compiled graph always holds the op: it returns at once there)."""
        if not torch.compiler.is_compiling():
            plan = _PLAN.get()
            if plan is not None and not plan.active and plan.num_tokens == x.shape[0]:
                return
        torch.ops.forwardkit.lora_add_(out, x, self.a, self.b, self.token_slots, self.max_loras)

    def slice_of(self, shard_id: Hashable | None) -> int:
        """Index of the slice with ``shard_id``; ``KeyError`` naming the known ids."""
        for i, sl in enumerate(self.slices):
            if sl.shard_id == shard_id:
                return i
        raise KeyError(f"no slice {shard_id!r}; slices: {[s.shard_id for s in self.slices]}")

    def clear(self, slot: int) -> None:
        """Zero slot ``slot`` (no adapter: adds nothing)."""
        w = self.slot_width
        with torch.no_grad():
            self.a[slot * w:(slot + 1) * w].zero_()
            self.b[slot * w:(slot + 1) * w].zero_()
        self._written()

    def load(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write slot ``slot``: per slice index, the full ``(A [r, in], B [out, r] x scaling)``
        (this rank's part is taken here); slices not given are zeroed."""
        w, r_max = self.slot_width, self.max_rank
        with torch.no_grad():
            # every row of the slot is written once: the adapter's rank rows of each slice it
            # has, zeros for the rest (B's entries outside a slice's own columns stay zero)
            for j, sl in enumerate(self.slices):
                col = slot * w + j * r_max
                cols = slice(sl.out_offset, sl.out_offset + sl.out_size)
                rank = 0
                if j in weights:
                    a_full, b_full = weights[j]
                    rank = a_full.shape[0]
                    a_part = a_full if sl.a_cols is None else a_full.narrow(1, *sl.a_cols)
                    b_part = b_full if sl.b_rows is None else b_full.narrow(0, *sl.b_rows)
                    self.a[col:col + rank].copy_(a_part)
                    self.b[col:col + rank, cols].copy_(b_part.t())
                if rank < r_max:
                    self.a[col + rank:col + r_max].zero_()
                    self.b[col + rank:col + r_max, cols].zero_()
        self._written()

    def extra_repr(self) -> str:
        ids = [s.shard_id for s in self.slices]
        return f"slots={self.max_loras}, max_rank={self.max_rank}, slices={ids}"


# The projections adapters may target, by the attribute name the model gives them.
LORA_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _slices_of(layer: Linear) -> tuple[list[LoRASlice], int | None]:
    """The LoRA slices of a projection layer and, row-parallel, its full input size."""
    if isinstance(layer, ColumnParallelLinear):
        out = []
        for (sid, (offset, size)), full in zip(layer.shard_offsets.items(), layer.full_output_sizes):
            rows = None
            if layer.tp_size > 1:
                rows = layer._local(sid, full, layer.tp_rank, layer.tp_size, "output size")
            out.append(LoRASlice(sid, offset, size, full, b_rows=rows))
        return out, None
    if isinstance(layer, RowParallelLinear):
        cols = None
        if layer.tp_size > 1:
            cols = (layer.tp_rank * layer.input_size, layer.input_size)
        return [LoRASlice(None, 0, layer.output_size, layer.output_size, a_cols=cols)], \
            layer.full_input_size
    if isinstance(layer, MergedLinear):
        return [LoRASlice(sid, off, size, size) for sid, (off, size) in layer.shard_offsets.items()], None
    return [LoRASlice(None, 0, layer.output_size, layer.output_size)], None


def attach_lora_slots(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                      max_num_tokens: int) -> tuple[torch.Tensor, dict[str, LoRASlots]]:
    """Give every LoRA-capable projection of ``model`` its :class:`LoRASlots` (``layer.lora``).

    Returns the shared per-token slot buffer (``max_num_tokens`` entries, all -1) and the
    slots by projection name (``model.layers.0.self_attn.qkv_proj``, ...)."""
    param = next(model.parameters())
    token_slots = torch.full((max_num_tokens,), -1, dtype=torch.long, device=param.device)
    found: dict[str, LoRASlots] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name.rsplit(".", 1)[-1] not in LORA_PROJECTIONS:
            continue
        slices, full_in = _slices_of(module)
        slots = LoRASlots(module.input_size, module.output_size, slices, max_loras, max_rank,
                          dtype, token_slots, full_input_size=full_in)
        module.lora = slots
        found[name] = slots
    return token_slots, found
