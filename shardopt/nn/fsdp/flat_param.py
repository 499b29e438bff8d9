"""The flat parameter of one FSDP unit: layout, local shard, full buffer and views.

Note [flat parameter layout]
A unit's parameters (deduplicated, in discovery order) are laid end to end in one flat
buffer of ``total_numel`` elements, padded with zeros to ``padded_numel``, a multiple of
the shard group size ``S``. Rank ``r`` of the shard group keeps elements
``[r * shard_numel, (r + 1) * shard_numel)`` as its *shard*, in the parameters' original
dtype: this is the master copy the optimizer steps. Each original ``nn.Parameter`` object
stays registered on its module under its original name; only its ``.data`` changes:

* sharded: a 1-D view of the part of the shard that overlaps the parameter (its *piece*,
  possibly empty), so ``optimizer.step()`` on ``model.parameters()`` updates the shard in
  place and optimizer state is sharded too;
* unsharded: a view with the original shape into the *full buffer*, which holds the
  all-gathered flat parameter in the compute dtype.

The full buffer is one tensor for the unit's lifetime; resharding frees its storage
(``resize_(0)``) and unsharding re-allocates the same storage, so tensors saved by autograd
that view it (e.g. ``weight.t()``) stay valid across a reshard/unshard pair. Swapping
``.data`` keeps the parameter's identity, autograd metadata and version counter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardopt import comm

__all__ = ["FlatLayout", "FlatParamHandle", "ParamSlot"]


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives in the flat parameter and in this rank's shard.

    Attributes:
        shape: the parameter's original shape.
        numel: its number of elements.
        offset: where it starts in the flat parameter.
        piece_begin: first element of the flattened parameter held by this rank.
        piece_numel: how many elements of it this rank holds (0 when none).
        shard_begin: where that piece starts inside this rank's shard.
    """

    shape: torch.Size
    numel: int
    offset: int
    piece_begin: int
    piece_numel: int
    shard_begin: int


@dataclass(frozen=True)
class FlatLayout:
    """The flat layout of a unit's parameters for one shard rank (Note [flat parameter layout]).

    Attributes:
        slots: one entry per parameter, in flat order.
        total_numel: elements of all parameters together.
        padded_numel: ``total_numel`` rounded up to a multiple of ``shard_size``.
        shard_numel: ``padded_numel // shard_size``.
        shard_rank: the rank this layout describes.
        shard_size: ranks the flat parameter is split over.
    """

    slots: tuple[ParamSlot, ...]
    total_numel: int
    padded_numel: int
    shard_numel: int
    shard_rank: int
    shard_size: int

    @staticmethod
    def build(shapes: list[torch.Size], shard_rank: int, shard_size: int) -> FlatLayout:
        """Lay out parameters of ``shapes`` end to end and cut them into ``shard_size`` shards.

        Args:
            shapes: the parameters' shapes in flat order.
            shard_rank: the rank whose pieces the slots describe.
            shard_size: number of shards (>= 1).

        Returns:
            The layout; the same shapes and sizes give the same layout on every rank.
        """
        total = sum(int(torch.Size(s).numel()) for s in shapes)
        padded = -(-total // shard_size) * shard_size if total else 0
        shard_numel = padded // shard_size
        lo, hi = shard_rank * shard_numel, (shard_rank + 1) * shard_numel
        slots, offset = [], 0
        for shape in shapes:
            numel = int(torch.Size(shape).numel())
            begin, end = max(lo, offset), min(hi, offset + numel)
            count = max(0, end - begin)
            slots.append(
                ParamSlot(
                    shape=torch.Size(shape),
                    numel=numel,
                    offset=offset,
                    piece_begin=begin - offset if count else 0,
                    piece_numel=count,
                    shard_begin=begin - lo if count else 0,
                )
            )
            offset += numel
        return FlatLayout(tuple(slots), total, padded, shard_numel, shard_rank, shard_size)


class FlatParamHandle:
    """One unit's parameters as a flat, sharded buffer with per-parameter views.

    How it works: see Note [flat parameter layout]. The handle owns the shard, the full
    buffer and the views; it never communicates (the unit calls :mod:`shardopt.comm`).

    Args:
        params: the unit's parameters, deduplicated, all of one dtype and device.
        shard_rank: this rank in the shard group.
        shard_size: size of the shard group.
        compute_dtype: dtype of the gathered parameters (the mixed precision ``param_dtype``
            or the parameters' own dtype).

    Raises:
        TypeError: the parameters do not share one dtype and device.
    """

    def __init__(
        self, params: list[nn.Parameter], shard_rank: int, shard_size: int, compute_dtype: torch.dtype | None
    ) -> None:
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise TypeError(
                f"the parameters of one FullyShardedDataParallel unit must share one dtype and device, got "
                f"{sorted(str(k) for k in kinds)}; cast the module first (module.to(dtype)) or wrap the "
                "differently typed submodules as separate units"
            )
        self.params = params
        self.master_dtype, self.device = params[0].dtype, params[0].device
        self.compute_dtype = compute_dtype or self.master_dtype
        self.layout = FlatLayout.build([p.shape for p in params], shard_rank, shard_size)
        lay = self.layout
        with torch.no_grad():
            flat = torch.zeros(lay.padded_numel, dtype=self.master_dtype, device=self.device)
            for p, slot in zip(params, lay.slots):
                flat[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            lo = lay.shard_rank * lay.shard_numel
            self.shard = flat[lo : lo + lay.shard_numel].clone()
        del flat
        self.full_is_shard = shard_size == 1 and self.compute_dtype == self.master_dtype
        if self.full_is_shard:
            self.full = self.shard
        else:
            self.full = torch.empty(lay.padded_numel, dtype=self.compute_dtype, device=self.device)
        self.shard_views = [self.shard[s.shard_begin : s.shard_begin + s.piece_numel] for s in lay.slots]
        self.full_views = self.views_into(self.full)
        self.free_full()
        self.use_shard_views()

    def views_into(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of every parameter, with original shapes, into a full flat buffer ``flat``."""
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.layout.slots]

    def use_shard_views(self) -> None:
        """Point every parameter at its (1-D, possibly empty) piece of the shard."""
        for p, view in zip(self.params, self.shard_views):
            p.data = view

    def use_views(self, views: list[torch.Tensor]) -> None:
        """Point every parameter at ``views`` (full shapes)."""
        for p, view in zip(self.params, views):
            p.data = view

    def alloc_full(self) -> None:
        """Give the full buffer its storage back (contents undefined) when it was freed."""
        if not self.full_is_shard:
            nbytes = self.layout.padded_numel * self.full.element_size()
            storage = self.full.untyped_storage()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)

    def free_full(self) -> None:
        """Release the full buffer's memory (its views stay valid objects)."""
        if not self.full_is_shard:
            comm.release_storage(self.full)

    def gather_source(self) -> torch.Tensor:
        """This rank's contribution to the all-gather of the full buffer (compute dtype)."""
        if self.compute_dtype == self.master_dtype:
            return self.shard
        return self.shard.to(self.compute_dtype)

    def trainable(self) -> list[tuple[nn.Parameter, ParamSlot]]:
        """The parameters that currently require gradients, with their slots."""
        return [(p, s) for p, s in zip(self.params, self.layout.slots) if p.requires_grad]

    def shard_range(self) -> tuple[int, int]:
        """This rank's ``[begin, end)`` in the flat parameter."""
        lo = self.layout.shard_rank * self.layout.shard_numel
        return lo, lo + self.layout.shard_numel
