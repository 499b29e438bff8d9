"""The flat parameter of one FSDP unit: layout, local shard, full buffer and views.

Note [flat parameter layout]
Every parameter of a unit (deduplicated, in discovery order) is sharded on its first
dimension, as FSDP2 does: with ``S`` ranks in the shard group and ``d0`` rows of
``row_numel`` elements each (a 0-d parameter counts as one row of one element), each rank
gets ``rows_per_rank = ceil(d0 / S)`` row slots and rank ``r`` holds rows
``[r * rows_per_rank, min((r + 1) * rows_per_rank, d0))`` (possibly none). Rank ``r``'s
*shard* is its row slots of every parameter laid end to end (each parameter's *segment*,
``rows_per_rank * row_numel`` elements, zero padded past the rows it holds), in the
parameters' original dtype: this is the master copy the optimizer steps. So the flat
buffer that an all-gather of the shards produces is *rank-major* (``S`` shards of
``shard_numel`` elements), and the gathered rows of one parameter are strided across it.
Each original ``nn.Parameter`` object stays registered on its module under its original
name; only its ``.data`` changes:

* sharded: a view of its rows in the shard, of shape ``(rows held, *shape[1:])`` (a 0-d
  parameter: ``(0,)`` or ``(1,)``), so ``p.dim()`` keeps its value after wrapping (shape
  based optimizer grouping works), ``optimizer.step()`` on ``model.parameters()`` updates
  the shard in place, and optimizer state is sharded too. ``p.numel()`` is this rank's
  count (rows held times ``row_numel``); ``FullyShardedDataParallel.full_parameter_shapes``
  gives the full shapes;
* unsharded: a view with the original shape into the *full buffer*, which holds the
  parameters *parameter-major* (each padded to ``S * rows_per_rank`` rows) in the compute
  dtype. After an all-gather into a temporary rank-major buffer, :meth:`FlatParamHandle.unpack`
  copies each parameter's rows out (one strided copy per parameter); gradients are copied
  the other way, into rank-major order, by :meth:`FlatParamHandle.pack` before the
  reduce-scatter (which replaces the copy into a flat buffer the reduction always made).
  With ``S == 1`` both orders are the same and nothing is copied.

The full buffer is one tensor for the unit's lifetime; resharding frees its storage
(``resize_(0)``) and unsharding re-allocates the same storage, so tensors saved by autograd
that view it (e.g. ``weight.t()``) stay valid across a reshard/unshard pair. Swapping
``.data`` keeps the parameter's identity, autograd metadata and version counter.

Cost against the former layout (1-D pieces of one parameter-major flat buffer, gathered
straight into the full buffer): one extra read and write of the unit's gathered bytes per
unshard, the temporary gathered buffer alive next to the full buffer until the copy-out
(peak ``+ padded_numel`` elements of the largest unit being gathered), and per-parameter
rather than per-unit padding (at most ``S - 1`` rows a parameter). Checkpoints are
unchanged: rank ``r``'s rows of a parameter are one contiguous range of its flattened
elements, so the 1-D ``ShardedTensor`` descriptions (Note [sharded state dict]) still hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardopt import comm
from shardopt.nn.fsdp.offload import HostShard, PendingDownload, land_grad

__all__ = ["FlatLayout", "FlatParamHandle", "ParamSlot"]


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives in the full buffer and in this rank's shard.

    Attributes:
        shape: the parameter's original shape.
        numel: its number of elements.
        offset: where it starts in the (parameter-major) full buffer.
        row_numel: elements of one row (``shape[1:]``'s numel; 1 for 0-d and 1-D).
        rows_per_rank: row slots every rank has for it (``ceil(rows / shard_size)``).
        local_shape: the shape of this rank's rows (``(rows held, *shape[1:])``).
        piece_begin: first element of the flattened parameter held by this rank (0 when none).
        piece_numel: how many elements of it this rank holds (0 when none).
        shard_begin: where its segment starts inside every rank's shard.
    """

    shape: torch.Size
    numel: int
    offset: int
    row_numel: int
    rows_per_rank: int
    local_shape: torch.Size
    piece_begin: int
    piece_numel: int
    shard_begin: int

    @property
    def segment_numel(self) -> int:
        """Elements of its segment in every shard (row slots times ``row_numel``)."""
        return self.rows_per_rank * self.row_numel


@dataclass(frozen=True)
class FlatLayout:
    """The row-sharded layout of a unit's parameters for one shard rank (Note [flat parameter layout]).

    Attributes:
        slots: one entry per parameter, in flat order.
        total_numel: elements of all parameters together.
        padded_numel: elements of the full (or gathered) buffer, ``shard_numel * shard_size``.
        shard_numel: elements of one rank's shard (the segments of all parameters).
        shard_rank: the rank this layout describes.
        shard_size: ranks the parameters are split over.
    """

    slots: tuple[ParamSlot, ...]
    total_numel: int
    padded_numel: int
    shard_numel: int
    shard_rank: int
    shard_size: int

    @staticmethod
    def build(shapes: list[torch.Size], shard_rank: int, shard_size: int) -> FlatLayout:
        """Shard every parameter of ``shapes`` on its first dimension over ``shard_size`` ranks.

        Args:
            shapes: the parameters' shapes in flat order.
            shard_rank: the rank whose rows the slots describe.
            shard_size: number of shards (>= 1).

        Returns:
            The layout; the same shapes and sizes give the same layout on every rank.
        """
        slots, offset, shard_offset, total = [], 0, 0, 0
        for shape in shapes:
            shape = torch.Size(shape)
            numel = int(shape.numel())
            rows = shape[0] if len(shape) else 1
            row_numel = int(shape[1:].numel()) if len(shape) else 1
            per_rank = -(-rows // shard_size)
            first = min(shard_rank * per_rank, rows)
            held = min(rows, first + per_rank) - first
            local = torch.Size([held, *shape[1:]]) if len(shape) else torch.Size([held])
            count = held * row_numel
            slots.append(
                ParamSlot(
                    shape=shape, numel=numel, offset=offset, row_numel=row_numel, rows_per_rank=per_rank,
                    local_shape=local, piece_begin=first * row_numel if count else 0, piece_numel=count,
                    shard_begin=shard_offset,
                )
            )
            offset += shard_size * per_rank * row_numel
            shard_offset += per_rank * row_numel
            total += numel
        return FlatLayout(tuple(slots), total, shard_offset * shard_size, shard_offset, shard_rank, shard_size)

    def rows_in(self, packed: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """The ``(shard_size, segment_numel)`` strided view of ``slot``'s segments in a
        rank-major buffer ``packed`` (an all-gather of the shards)."""
        return packed.view(self.shard_size, self.shard_numel)[:, slot.shard_begin : slot.shard_begin + slot.segment_numel]

    def full_rows(self, full: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """The same ``(shard_size, segment_numel)`` rows in a parameter-major buffer ``full``."""
        return full[slot.offset : slot.offset + self.shard_size * slot.segment_numel].view(
            self.shard_size, slot.segment_numel
        )


def _pack_one(dst: torch.Tensor, grad: torch.Tensor | None, slot: ParamSlot, accumulate: bool) -> None:
    """Write (or add) a full-shaped ``grad`` into its ``(S, segment_numel)`` rows ``dst``,
    zeros in the padding rows (Note [flat parameter layout])."""
    if grad is None:
        if not accumulate:
            dst.zero_()
        return
    flat, seg = grad.reshape(-1), slot.segment_numel
    whole, rest = divmod(slot.numel, seg)  # ranks whose row slots are all filled, and the remainder
    op = torch.Tensor.add_ if accumulate else torch.Tensor.copy_
    op(dst[:whole], flat[: whole * seg].view(whole, seg))
    if whole < dst.shape[0]:
        op(dst[whole, :rest], flat[whole * seg :])
        if not accumulate:
            dst[whole, rest:].zero_()
            dst[whole + 1 :].zero_()


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
        offload: keep the shard (and the sharded gradients) in host memory (Note [offloaded
            shards] in ``offload``); the parameters' device stays the compute device.

    Raises:
        TypeError: the parameters do not share one dtype and device.
    """

    def __init__(
        self, params: list[nn.Parameter], shard_rank: int, shard_size: int, compute_dtype: torch.dtype | None,
        offload: bool = False,
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
        """The parameters' dtype, and the compute device (the gathered parameters' one)."""
        self.compute_dtype = compute_dtype or self.master_dtype
        self.layout = FlatLayout.build([p.shape for p in params], shard_rank, shard_size)
        self.host = HostShard(self.device) if offload else None
        """Where an offloaded shard lives and how it moves (``None``: the shard is on ``device``)."""
        lay = self.layout
        with torch.no_grad():
            if self.host is not None:
                self.shard = self.host.zeros(lay.shard_numel, self.master_dtype)
            else:
                self.shard = torch.zeros(lay.shard_numel, dtype=self.master_dtype, device=self.device)
            for p, slot in zip(params, lay.slots, strict=True):
                self.local_of(self.shard, slot).copy_(
                    p.detach().reshape(-1)[slot.piece_begin : slot.piece_begin + slot.piece_numel].view(slot.local_shape)
                )
        self.full_is_shard = shard_size == 1 and self.compute_dtype == self.master_dtype and self.host is None
        if self.full_is_shard:
            self.full = self.shard
        else:
            self.full = torch.empty(lay.padded_numel, dtype=self.compute_dtype, device=self.device)
        self.shard_views = [self.local_of(self.shard, s) for s in lay.slots]
        self.full_views = self.views_into(self.full)
        self.free_full()
        self.use_shard_views()

    def local_of(self, shard: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """This rank's rows of ``slot`` in a shard-sized buffer ``shard``, shaped ``slot.local_shape``."""
        return shard[slot.shard_begin : slot.shard_begin + slot.piece_numel].view(slot.local_shape)

    def views_into(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Views of every parameter, with original shapes, into a parameter-major buffer ``full``."""
        return [full[s.offset : s.offset + s.numel].view(s.shape) for s in self.layout.slots]

    def unpack(self, packed: torch.Tensor, full: torch.Tensor | None = None) -> torch.Tensor:
        """Copy a rank-major gathered buffer into parameter-major order (Note [flat parameter layout]).

        Args:
            packed: ``padded_numel`` elements, the shards of every rank in rank order.
            full: where to write (``padded_numel`` elements); a new tensor when ``None``.

        Returns:
            ``full`` (``packed`` itself with one shard, where both orders are the same).
        """
        lay = self.layout
        if lay.shard_size == 1:
            if full is None or full.data_ptr() == packed.data_ptr():
                return packed
            return full.copy_(packed)
        out = torch.empty_like(packed) if full is None else full
        with torch.no_grad():
            for slot in lay.slots:
                if slot.segment_numel:
                    lay.full_rows(out, slot).copy_(lay.rows_in(packed, slot))
        return out

    def pack(self, grads: list[torch.Tensor | None], packed: torch.Tensor, accumulate: bool) -> None:
        """Write (or add) full-shaped ``grads`` into a rank-major buffer of ``padded_numel``
        elements, ready to reduce-scatter; a ``None`` writes zeros (Note [flat parameter layout])."""
        lay = self.layout
        with torch.no_grad():
            for grad, slot in zip(grads, lay.slots, strict=True):
                if slot.segment_numel:
                    _pack_one(lay.rows_in(packed, slot), grad, slot, accumulate)

    def write_local(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Copy this rank's rows of every parameter from a parameter-major ``full`` into ``shard``."""
        lay = self.layout
        with torch.no_grad():
            for slot in lay.slots:
                if slot.piece_numel:
                    begin = slot.offset + slot.piece_begin
                    shard[slot.shard_begin : slot.shard_begin + slot.piece_numel].copy_(
                        full[begin : begin + slot.piece_numel]
                    )

    def use_shard_views(self) -> None:
        """Point every parameter at its rows of the shard (shape ``slot.local_shape``)."""
        for p, view in zip(self.params, self.shard_views, strict=True):
            p.data = view

    def use_views(self, views: list[torch.Tensor]) -> None:
        """Point every parameter at ``views`` (full shapes)."""
        for p, view in zip(self.params, views, strict=True):
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
        """This rank's contribution to the all-gather of the full buffer (compute dtype, on
        the compute device: an offloaded shard is uploaded first, Note [offloaded shards])."""
        shard = self.on_compute(self.shard)
        if self.compute_dtype == self.master_dtype:
            return shard
        return shard.to(self.compute_dtype)

    def on_compute(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` (a shard-sized tensor of this handle) on the compute device: itself, or
        an upload of it when the shard is offloaded."""
        return shard if self.host is None else self.host.upload(shard)

    def settle(self) -> None:
        """Before a host write to an offloaded shard: wait until no upload can still read it."""
        if self.host is not None:
            self.host.settle()

    def land_grads(self, grads: torch.Tensor, trainable: list[tuple[nn.Parameter, ParamSlot]]) -> PendingDownload | None:
        """Give every parameter of ``trainable`` its rows of a reduced gradient shard ``grads``
        (as its ``.grad``, or added to it); for an offloaded shard, start the download whose
        record does that when it lands (Note [offloaded shards]).

        Returns:
            The download to land at the end of backward, or ``None`` (already given).
        """
        if self.host is None:
            for p, slot in trainable:
                land_grad(p, self.local_of(grads, slot))
            return None
        return self.host.download(grads, lambda host: [(p, self.local_of(host, s)) for p, s in trainable])

    def trainable(self) -> list[tuple[nn.Parameter, ParamSlot]]:
        """The parameters that currently require gradients, with their slots."""
        return [(p, s) for p, s in zip(self.params, self.layout.slots, strict=True) if p.requires_grad]
