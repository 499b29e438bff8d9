"""Master weights for :class:`~shardopt.optim.OSS`: mixed-precision ZeRO-1/2.

Note [master weights]
With ``OSS(..., master_dtype=torch.float32)`` over bf16 or fp16 parameters, the rank that
owns a parameter keeps a copy of it in ``master_dtype`` (its *master*), and only that rank:
the wrapped torch optimizer is built over the masters, so its state (Adam's moments,
momentum) is fp32 too. A step folds the gradient into the master's fp32 ``.grad`` (Note
[master gradients]), updates the master, rounds it into the low-precision parameter
(``param.copy_(master)``, round to nearest even) and frees the master's gradient; the
parameters are then gathered in their own dtype, half the bytes of fp32. Per parameter
that is 2 bytes of bf16 weights on every rank plus, with Adam, 16 bytes (master, two
moments, gradient during the step) on its owner only: ``2 + 16/N`` bytes per parameter,
against DDP-with-fp32-masters' 2 + 16.

Which parameters get one is a rule on the dtype alone (:func:`needs_master`), so every rank
(and ShardedDataParallel, which plans its buckets with it) reaches the same answer without
talking: a trainable floating parameter narrower than ``master_dtype``. A parameter already
in ``master_dtype`` (an fp32 norm in a bf16 model) is stepped as itself, as without masters.
A parameter that ``master_dtype`` cannot hold exactly (wider, or as wide but another format,
fp16 under a bf16 master) is refused. A frozen parameter's master, if it has one, is kept
with its parked optimizer state (Note [parked state] in :mod:`shardopt.optim.oss`) and moves
with it; a master is only ever created from its parameter when none exists on its owner.

Note [master gradients]
What a step uses, for each master: ``master.grad`` (fp32), to which any ``param.grad`` on the
owner is added in ``master_dtype`` and then freed. ShardedDataParallel writes the reduced,
averaged gradient straight into ``master.grad`` (and adds there across backward passes, so
accumulation sums in fp32); under DDP (ZeRO-1) the gradient arrives in ``param.grad`` and is
cast here. The fold runs at the step, and earlier where fp32 gradients are needed first
(``ShardedGradScaler.unscale_``, ``OSS.clip_grad_norm``): after it the owner holds no
low-precision gradient for its parameters. After the step every master's gradient is freed,
as DeepSpeed frees its fp32 gradient partition; ``OSS.zero_grad`` frees them too, whatever
``set_to_none`` says (a freed gradient adds exactly as zeros would). The masters' gradients
are views of one buffer per param group, as the masters are of another (Note [flat masters]
in :mod:`shardopt.optim.flat_masters`).

Note [masters follow outside writes]
A master is the truth for its parameter, so a write to the parameter that the optimizer does
not see (``model.load_state_dict`` after the optimizer was built, ShardedDataParallel's
start-up broadcast, a weight clamp under ``torch.no_grad()``) would be undone by the next
step. Before the optimizer uses the masters (a step, a state dict), each master is checked
against its parameter: if the two were never compared (a new, migrated or loaded master) or
the parameter's version counter moved since they last agreed, and the parameter differs from
the master rounded to its dtype, the master is re-created from the parameter. The first
comparison also catches writes made before the first step that bypass the version counter
(DDP's and ShardedDataParallel's start-up broadcasts write through ``.data``). The version
check is a Python integer comparison per parameter; the value comparison runs once per
write. A write that bypasses the version counter (``param.data.copy_(...)``) after the first
step is not seen: write through ``torch.no_grad()`` instead.

Note [offloaded masters]
With ``OSS(..., offload="cpu")`` (ZeRO-Offload) every trainable parameter a rank owns gets a
master in host memory: a low-precision one in ``master_dtype`` as above, any other one a
*mirror* in its own dtype (an fp32 parameter's exact fp32 copy). The wrapped optimizer is
built over them, so its state lives on the host and its step runs there, on torch's CPU
kernels (a flat tensor per group: Note [flat masters] in :mod:`shardopt.optim.flat_masters`).
Gradients reach the masters as without offload, copied device to host: ShardedDataParallel
copies each reduced gradient as it arrives, under DDP the fold copies them at the step. The
step ends with each master copied host to device into its parameter, and the gather runs on
the device as before. On a GPU the buffers are pinned; the gradient buffer is kept between
steps rather than freed (allocating and first touching 4 bytes per owned parameter was
460-580 ms of a 50M-parameter host step on the project's CPU machine). On a GPU
ShardedDataParallel's copies to the host and the step's copies back run on a copy stream,
overlapping backward and the gather, and the host waits for them once per step (Note [offload
copies on a side stream] in :mod:`shardopt.optim.offload_copies`; written and checked on CPU
ranks against a simulated device, not yet run on a GPU); so do DDP's gradients (ZeRO-1),
copied at the fold, and a mirror's, handed back after the step.
A mirror's gradient outlives the step as its parameter's would (Note [mirrors carry
gradients]). A mirror holds nothing its parameter does not, so it is never saved: checkpoints keep
today's keys and load with or without offload, and a mirror restarts from its parameter at a
load or a re-partition, silently. On a CPU the parameters are already in host memory, so
offload there only adds the mirrors' bytes; it exists there so that the same code (and its
exactness against the run without offload) is tested on every machine. With
``delay_update_after`` the step runs on a worker thread over a copy of the gradient buffer
(Note [delayed update] in :mod:`shardopt.optim.delayed_update`).

Note [mirrors carry gradients]
Without offload an fp32 parameter is stepped as itself and its gradient outlives the step
(DDP's semantics: a script that calls ``zero_grad`` every few steps sums the steps between).
A mirror must keep that, or offload would change such a script's training (measured: the
first run of the offload tests without this differed from the run without offload). So after
the step a mirror's gradient is not freed: under DDP (ZeRO-1) the fold took ``param.grad``
(the tensor is kept aside) and the step hands it back with the mirror's values, clipped and
unscaled as DDP's own would be; under ShardedDataParallel the reduced sum stays in the
mirror's ``.grad`` behind a placeholder in ``param.grad`` (Note [placeholders for moved
gradients] in :mod:`shardopt.placeholders`), as a split parameter's rows do. A master in a
wider dtype consumes its gradient at the step, as before (Note [master gradients]).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch

from shardopt.optim.flat_masters import FlatGroup
from shardopt.optim.offload_copies import OffloadCopies, Uploads
from shardopt.placeholders import is_placeholder, leave_placeholder, take_placeholder
from shardopt.state_checks import MASTER_KEY

__all__ = ["MASTER_KEY", "OFFLOAD_DEVICES", "MasterWeights", "check_master_dtype", "check_offload", "is_placeholder",
           "leave_placeholder", "needs_master", "take_placeholder"]

OFFLOAD_DEVICES = ("cpu",)
"""The values ``OSS(offload=...)`` takes besides ``None``."""

logger = logging.getLogger(__name__)


def needs_master(param_dtype: torch.dtype, master_dtype: torch.dtype | None) -> bool:
    """Whether a trainable parameter of ``param_dtype`` gets a master (Note [master weights]).

    Args:
        param_dtype: the parameter's dtype.
        master_dtype: the optimizer's ``master_dtype`` (``None``: masters are off).

    Returns:
        ``True`` for a floating dtype narrower than ``master_dtype``.
    """
    return (master_dtype is not None and param_dtype.is_floating_point and param_dtype != master_dtype
            and param_dtype.itemsize < master_dtype.itemsize)


def check_master_dtype(master_dtype: object, params: Sequence[torch.Tensor]) -> bool:
    """Refuse a ``master_dtype`` that is no floating dtype or cannot hold every parameter.

    Args:
        master_dtype: the value given to ``OSS(master_dtype=...)``.
        params: every parameter of the optimizer, in order (frozen ones too: they may be
            unfrozen later).

    Returns:
        Whether any parameter gets a master (``False`` for ``None``, or when every floating
        parameter is already in ``master_dtype``).

    Raises:
        TypeError: ``master_dtype`` is not a ``torch.dtype``.
        ValueError: ``master_dtype`` is not floating, or is narrower than (or as wide as but
            another format than) a parameter, or a trainable parameter is not floating.
    """
    if master_dtype is None:
        return False
    if not isinstance(master_dtype, torch.dtype):
        raise TypeError(f"master_dtype must be a torch.dtype such as torch.float32, got {type(master_dtype).__name__} "
                        f"{master_dtype!r}; pass OSS(..., master_dtype=torch.float32)")
    if not master_dtype.is_floating_point:
        raise ValueError(f"master_dtype must be a floating dtype, got {master_dtype}; master weights hold the "
                         "parameters' exact values: pass master_dtype=torch.float32")
    for i, p in enumerate(params):
        if p.dtype == master_dtype or needs_master(p.dtype, master_dtype):
            continue
        if not p.dtype.is_floating_point and not p.requires_grad:
            continue  # an integer parameter is never trained
        raise ValueError(
            f"master_dtype={master_dtype} cannot hold parameter {i} (shape {tuple(p.shape)}, dtype {p.dtype}): "
            "a master must be wider than its parameter (or the same dtype, which keeps none); pass a wider "
            f"master_dtype (torch.float32 for bf16/fp16 parameters, torch.float64 for fp32 ones) or cast the "
            "model to a narrower dtype"
        )
    return any(needs_master(p.dtype, master_dtype) for p in params)


def check_offload(offload: object) -> torch.device | None:
    """The host device of ``OSS(offload=...)`` (Note [offloaded masters]), ``None`` without.

    Raises:
        ValueError: ``offload`` is neither ``None`` nor one of :data:`OFFLOAD_DEVICES`.
    """
    if offload is None:
        return None
    if isinstance(offload, str) and offload in OFFLOAD_DEVICES:
        return torch.device(offload)
    hint = " (NVMe offload is not implemented)" if offload == "nvme" else ""
    raise ValueError(f"offload must be None or 'cpu', got {offload!r}{hint}; pass offload='cpu' to keep the masters and "
                     "optimizer state in host memory and step there, or offload=None (default) to keep them with "
                     "the parameters")


class MasterWeights:
    """This rank's master copies of the trainable parameters it owns (Note [master weights]).

    How it works: masters are keyed by the parameter's index in ``OSS.params``. The owning
    optimizer rebuilds the set whenever ownership changes, handing over the masters it
    carried (kept, migrated or loaded); every other method walks the current set. The
    masters of one param group on one device are views of one buffer, and their gradients
    of a second (Note [flat masters] in :mod:`shardopt.optim.flat_masters`). With
    ``dtype=None`` the set is always empty and every method is a no-op.

    Args:
        dtype: the masters' dtype (``OSS.master_dtype``), or ``None`` for no masters.
        offload: the host device every master lives on (Note [offloaded masters]), or
            ``None``: each master lives on its parameter's device.
    """

    def __init__(self, dtype: torch.dtype | None, offload: torch.device | None = None) -> None:
        self.dtype = dtype
        self.offload = offload
        self._mirrors: set[int] = set()  # masters in their parameter's own dtype (Note [offloaded masters])
        self._lent: dict[int, torch.Tensor] = {}  # a mirror's param.grad, handed back after the step
        self._masters: dict[int, torch.Tensor] = {}
        self._groups: list[FlatGroup] = []
        self._group_of: dict[int, FlatGroup] = {}
        self._agreed: dict[int, int | None] = {}  # param._version when it last equalled its master
        self._rows: dict[int, tuple[int, int]] = {}  # the rows a master copies, for a split parameter only
        self.copies = OffloadCopies()
        """The host<->device copies of offloaded masters (Note [offload copies on a side stream] in
        :mod:`shardopt.optim.offload_copies`); unused without offload."""

    def _part(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """What the master of ``params[index]`` copies: the parameter, or its owned rows (a view)."""
        rows = self._rows.get(index)
        return param.detach() if rows is None else param.detach()[rows[0] : rows[1]]

    def __len__(self) -> int:
        return len(self._masters)

    def dtype_for(self, param_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype of the master a trainable parameter of ``param_dtype`` gets on its owner:
        ``dtype`` for a narrower one (Note [master weights]), its own under offload (a
        mirror, Note [offloaded masters]), else ``None`` (stepped as itself)."""
        if needs_master(param_dtype, self.dtype):
            return self.dtype
        return param_dtype if self.offload is not None and param_dtype.is_floating_point else None

    def saved_items(self) -> Iterable[tuple[int, torch.Tensor]]:
        """``(index, master)`` of the masters a checkpoint keeps: all but the mirrors."""
        return ((i, m) for i, m in self._masters.items() if i not in self._mirrors)

    def get(self, index: int) -> torch.Tensor | None:
        """The master of ``params[index]``, or ``None`` when this rank keeps none for it."""
        return self._masters.get(index)

    def items(self) -> Iterable[tuple[int, torch.Tensor]]:
        """``(index, master)`` pairs, by index."""
        return self._masters.items()

    @property
    def groups(self) -> list[FlatGroup]:
        """The buffers holding the masters, one per (param group, device)."""
        return list(self._groups)

    def group_of(self, index: int) -> FlatGroup | None:
        """The buffer holding the master of ``params[index]``, if it has one."""
        return self._group_of.get(index)

    def host_buffers(self) -> list[torch.Tensor]:
        """Every host buffer of the offloaded groups (``OSS.offloaded_buffers``); ``[]`` without offload."""
        return [t for g in self._groups for t in g.host_buffers()]

    @torch.no_grad()
    def rebuild(self, params: Sequence[torch.Tensor], indices: Iterable[int],
                carried: Mapping[int, torch.Tensor], rows: Mapping[int, tuple[int, int]] | None = None,
                group_of: Sequence[int] | None = None, flatten: bool = False) -> None:
        """Keep masters for ``params[i]``, ``i`` in ``indices`` (this rank's trainable ones).

        Args:
            params: every parameter, by index.
            indices: the trainable parameters this rank owns now.
            carried: masters that already exist for some of them (copied into the new
                buffers, cast to ``dtype``), of the rows they copy. The others are created
                from their parameter.
            rows: for a parameter split across ranks, the dim-0 rows this rank owns: its
                master copies only those.
            group_of: the param group of each parameter (all in one group when omitted).
            flatten: whether the optimizer updates element by element, so that a group's
                aligned masters may be stepped as one tensor (Note [aligned segments] in
                :mod:`shardopt.optim.flat_masters`).
        """
        self.copies.land()  # nothing may still write the old buffers or read the masters
        self._rows = {i: r for i, r in (rows or {}).items() if i in set(indices)}
        entries: dict[tuple[int, str, torch.dtype], list[tuple[int, torch.Size]]] = {}
        pin: dict[tuple[int, str, torch.dtype], bool] = {}
        for i in sorted(indices):
            dtype = self.dtype_for(params[i].dtype)
            if dtype is not None:
                device = self.offload or params[i].device
                key = (0 if group_of is None else group_of[i], str(device), dtype)
                entries.setdefault(key, []).append((i, self._part(i, params[i]).shape))
                pin[key] = pin.get(key, False) or (self.offload is not None and params[i].device.type == "cuda")
        host = self.offload is not None
        self._groups = [FlatGroup(key[0], torch.device(key[1]), key[2], found, flatten, host=host, pin=pin[key],
                                  copies=self.copies if host else None)
                        for key, found in sorted(entries.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2])))]
        self._group_of = {i: g for g in self._groups for i in g.masters}
        self._masters = {i: self._group_of[i].masters[i] for i in sorted(self._group_of)}
        self._mirrors = {i for i, m in self._masters.items() if m.dtype == params[i].dtype}
        self._agreed = {}
        for i, master in self._masters.items():
            source = None if i in self._mirrors else carried.get(i)
            master.copy_(self._part(i, params[i]) if source is None else source.detach())
            self._agreed[i] = None  # compared at the first use (Note [masters follow outside writes])

    @torch.no_grad()
    def follow_outside_writes(self, params: Sequence[torch.Tensor]) -> None:
        """Re-create from its parameter any master the parameter no longer rounds from
        (Note [masters follow outside writes])."""
        for i, master in self._masters.items():
            p = params[i]
            if self._agreed[i] == p._version:
                continue
            part = self._part(i, p)
            if not torch.equal(master.to(part.device, p.dtype), part):  # host-read: only after an outside write
                logger.info("parameter %s was written outside the optimizer; its master follows it", i)
                self.copies.land()  # an upload may still read it (Note [offload copies on a side stream])
                master.copy_(part)
            self._agreed[i] = p._version

    @torch.no_grad()
    def fold_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Add each parameter's ``.grad`` into its master's, in ``dtype``, and free it; every
        master's gradient ends in the gradient buffer (Note [master gradients]; Note [flat
        masters] in :mod:`shardopt.optim.flat_masters`). Lands the copies to the host: every reader
        of the gradient buffer and the step run this. Offloaded masters of CUDA parameters take
        DDP's gradients (ZeRO-1) on the copy stream, landed with the rest: one host wait (Note
        [offload copies on a side stream] in :mod:`shardopt.optim.offload_copies`, 1 and 3)."""
        fresh: dict[FlatGroup, list[tuple[int, torch.Tensor]]] = {g: [] for g in self._groups}
        for i, master in self._masters.items():
            p = params[i]
            if not take_placeholder(p):  # Note [placeholders for moved gradients] in shardopt.placeholders
                master.grad = None
            grad = p.grad
            if grad is None:
                continue
            rows = self._rows.get(i)
            if i in self._mirrors:  # DDP's gradient: given back after the step (Note [mirrors carry gradients])
                self._lent[i] = grad
            grad = (grad if rows is None else grad[rows[0] : rows[1]]).detach()
            if self.offload is not None and self.copies.overlaps(grad.device):
                self._group_of[i].add_grad(i, grad)  # on the copy stream; landed below
            elif master.grad is None:
                fresh[self._group_of[i]].append((i, grad))
            else:  # synchronous: nothing of this master's is in flight
                master.grad.add_(grad.to(master.device))
            p.grad = None
        self.copies.land()
        for group, grads in fresh.items():  # a gradient put elsewhere (ShardedDataParallel's sum) moves in too
            group.take_grads(grads)

    @torch.no_grad()
    def write_back(self, params: Sequence[torch.Tensor], order: Sequence[int] = ()) -> Uploads:
        """Round every master into its parameter (after a step), those of ``order`` (the
        gather's send order) first and in it.

        Returns:
            The copies in flight, for the gather to wait for (empty unless offloaded masters of
            CUDA parameters were copied on a copy stream: Note [offload copies on a side stream]).
        """
        uploads = Uploads()
        if self._masters:
            position = {i: k for k, i in enumerate(order)}
            indices = sorted(self._masters, key=lambda i: (position.get(i, len(position)), i))
            targets = [self._part(i, params[i]) for i in indices]
            if self.offload is None:
                torch._foreach_copy_(targets, [self._masters[i] for i in indices])
            else:
                uploads = self.copies.upload([(params[i], t, self._masters[i], self._rounding(i, params[i]))
                                              for i, t in zip(indices, targets, strict=True)])
        for i in self._masters:
            self._agreed[i] = params[i]._version
        return uploads

    def _rounding(self, index: int, param: torch.Tensor) -> torch.Tensor | None:
        """Where the master of ``params[index]`` is rounded on the host before a copy to the device
        that would cast (a master of a CUDA parameter in another dtype), else ``None`` (a mirror, or a
        synchronous copy on the CPU, as before): Note [offload copies on a side stream], 4."""
        master = self._masters[index]
        if master.dtype == param.dtype or not self.copies.overlaps(param.device):
            return None
        return self._group_of[index].upload_source(index, param.dtype)

    @torch.no_grad()
    def release_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Free the masters' gradients once the step has its own (Note [delayed update] in
        :mod:`shardopt.optim.delayed_update`), but a mirror's: that one goes on as its
        parameter's would (Note [mirrors carry gradients])."""
        kept = set()
        handed: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in self._mirrors:
            master, lent = self._masters[i], self._lent.get(i)
            if master.grad is None:
                continue
            if lent is not None:  # back into DDP's gradient: the clipped, unscaled values, as DDP's own
                rows = self._rows.get(i)
                handed.append((lent if rows is None else lent[rows[0] : rows[1]], master.grad))
                params[i].grad = lent
            else:  # ShardedDataParallel's sum stays, behind a placeholder
                kept.add(i)
                if params[i].grad is None:
                    leave_placeholder(params[i])
        self._lent = {}
        self.copies.hand_back(handed)  # on the copy stream on a GPU (Note [offload copies on a side stream], 5)
        for group in self._groups:
            group.free_grads(keep=kept)

    def after_gather(self, params: Sequence[torch.Tensor]) -> None:
        """The post-step gather wrote the other owners' rows of the split parameters: their
        masters' rows are untouched, so they still agree (without this the next step would
        compare each one with its rows, a host read per split master per step; Note [masters
        follow outside writes]). The current stream then waits for the last upload (Note
        [offload copies on a side stream])."""
        self.copies.join_uploads()
        for i in self._rows:
            if i in self._masters:
                self._agreed[i] = params[i]._version

    def free_grads(self) -> None:
        """Drop every master's gradient and the gradient buffers."""
        self._lent = {}
        for group in self._groups:
            group.free_grads()

    @torch.no_grad()
    def load(self, params: Sequence[torch.Tensor], saved: Mapping[int, torch.Tensor]) -> list[int]:
        """Overwrite the masters from ``saved`` (by index, of the rows each master copies); the
        ones it lacks restart from their parameter.

        Returns:
            The indices whose master restarted from the parameter (a mirror always does, and is
            not counted: Note [offloaded masters]).
        """
        self.copies.land()  # an upload may still read the masters
        missing = []
        for i, master in self._masters.items():
            value = None if i in self._mirrors else saved.get(i)
            if value is None:
                if i not in self._mirrors:
                    missing.append(i)
                value = self._part(i, params[i])
            master.copy_(value)
            self._agreed[i] = None
        return missing
