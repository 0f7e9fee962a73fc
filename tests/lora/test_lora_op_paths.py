"""``forwardkit::lora_add_``'s CPU paths against a float64 reference: the packed copies of the
mixed path, the native few-row kernel of the one-adapter path, the plain fallbacks, the
device-mask path without a plan; the derived copies follow slot writes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forwardkit.kernels.cpu import native_linear
from forwardkit.kernels.cpu.router import prepack_supported
from forwardkit.layers import lora as L

SLOTS, RANK, IN, OUT = 4, 8, 64, 96
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _slots(dtype: torch.dtype, seed: int = 0) -> L.LoRASlots:
    token_slots = torch.full((32,), -1, dtype=torch.long)
    slots = L.LoRASlots(IN, OUT, [L.LoRASlice("q", 0, 48, 48), L.LoRASlice("k", 48, 48, 48)],
                        SLOTS, RANK, dtype, token_slots)
    gen = torch.Generator().manual_seed(seed)
    for s in range(SLOTS):  # slice "k" has a smaller rank (zero-padded rows)
        slots.load(s, {0: (torch.randn(RANK, IN, generator=gen), torch.randn(48, RANK, generator=gen)),
                       1: (torch.randn(3, IN, generator=gen), torch.randn(48, 3, generator=gen))})
    return slots


def _reference(slots: L.LoRASlots, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    w = slots.slot_width
    a, b = slots.a.double(), slots.b.double()
    out = torch.zeros(x.shape[0], OUT, dtype=torch.float64)
    for i, s in enumerate(rows):
        if s >= 0:
            out[i] = (x[i].double() @ a[s * w:(s + 1) * w].T) @ b[s * w:(s + 1) * w]
    return out


def _run(slots: L.LoRASlots, x: torch.Tensor, rows: list[int], plan: bool) -> tuple[torch.Tensor, L.LoRAOpCounts]:
    """The op's result for ``rows`` (slot per row) and the counts it added."""
    slots.token_slots[:len(rows)] = torch.tensor(rows)
    out = torch.zeros(x.shape[0], OUT, dtype=x.dtype)
    before = dataclasses.replace(L.lora_op_counts)
    bound = L.LoRAStepPlan(rows, SLOTS, x.dtype, x.device) if plan else None
    with L.bind_plan(bound):
        torch.ops.forwardkit.lora_add_(out, x, slots.a, slots.b, slots.token_slots, SLOTS)
    after = L.lora_op_counts
    return out, L.LoRAOpCounts(*(getattr(after, f.name) - getattr(before, f.name)
                                 for f in dataclasses.fields(after)))


def _check(slots: L.LoRASlots, x: torch.Tensor, rows: list[int], plan: bool) -> L.LoRAOpCounts:
    out, counts = _run(slots, x, rows, plan)
    want = _reference(slots, x, rows)
    scale = want.abs().max().item()
    assert scale > 1 and (out.double() - want).abs().max().item() <= TOL[x.dtype] * scale
    assert counts.calls == counts.applied == 1
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_path_matches_the_reference(dtype):
    slots = _slots(dtype)
    gen = torch.Generator().manual_seed(1)
    x16 = torch.randn(16, IN, generator=gen).to(dtype)
    mixed = [i % (SLOTS + 1) - 1 for i in range(16)]  # every slot and rows without one
    counts = _check(slots, x16, mixed, plan=True)
    assert counts.packed == int(prepack_supported(dtype))
    assert _check(slots, x16, mixed, plan=False).packed == int(prepack_supported(dtype))
    for n in (1, 2, 5):  # one adapter for every row: the native kernel serves one or two rows
        counts = _check(slots, x16[:n], [2] * n, plan=True)
        assert counts.native == int(n <= native_linear.MAX_ROWS and native_linear.available(dtype))
        assert counts.packed == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_slot_writes_refresh_the_derived_copies(dtype):
    if not (prepack_supported(dtype) and native_linear.available(dtype)):
        pytest.skip(f"the {dtype} packed copies and native kernel need AVX-512 (and a native "
                    "bf16 matmul for bf16); this CPU lacks one")
    slots = _slots(dtype)
    x = torch.randn(16, IN, generator=torch.Generator().manual_seed(2)).to(dtype)
    mixed = [i % (SLOTS + 1) - 1 for i in range(16)]
    _check(slots, x, mixed, plan=True)  # the derived copies exist now
    _check(slots, x[:1], [2], plan=True)
    other = _slots(dtype, seed=7)
    slots.load(2, {0: (other.a[2 * 16:2 * 16 + RANK].float(), other.b[2 * 16:2 * 16 + RANK, :48].T.float())})
    repacks = L.lora_op_counts.repacks
    assert _check(slots, x, mixed, plan=True).packed == 1
    assert _check(slots, x[:1], [2], plan=True).native == 1
    assert L.lora_op_counts.repacks == repacks + 2  # re-derived once each, not per call
    _check(slots, x, mixed, plan=True)
    assert L.lora_op_counts.repacks == repacks + 2
    slots.clear(1)
    assert _check(slots, x, mixed, plan=True).packed == 1
    out, counts = _run(slots, x[:2], [1, 1], plan=True)
    assert counts.native == 1 and not out.any()  # a cleared slot adds nothing
