"""Parameter precision for ``shardopt demo`` and ``shardopt bench``: one frozen :class:`Precision`.

Three precisions (``--precision``, and a bench mode name's suffix):

- ``fp32`` (no suffix): fp32 parameters, gradients and optimizer state, as before.
- ``bf16`` (suffix ``-bf16``): the model is cast to bf16 and trained as it is, so
  gradients and Adam's state are bf16 too (what ``model.to(torch.bfloat16)`` under DDP
  does: the usual "bf16 parameters" baseline).
- ``bf16-master`` (suffix ``-bf16m``): bf16 parameters with fp32 master weights on the rank
  that owns them (``OSS(..., master_dtype=torch.float32)``): the owner steps its fp32
  masters, rounds them into the bf16 parameters and re-gathers those in bf16.

With ``bf16-master`` ZeRO-2 sends gradients to their owner in fp32 (default) or bf16
(``--reduce-dtype bf16``, suffix ``-bf16reduce``); ZeRO-1's DDP all-reduces them in bf16. ``--amp`` (autocast over fp32
parameters) is another road to mixed precision and does not combine with these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PRECISIONS", "REDUCE_DTYPES", "Precision"]

PRECISIONS = ("fp32", "bf16", "bf16-master")
"""The values of ``--precision``."""

REDUCE_DTYPES = ("fp32", "bf16")
"""The values of ``--reduce-dtype``."""

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SUFFIXES = {"fp32": "", "bf16": "-bf16", "bf16-master": "-bf16m"}
_REDUCE_SUFFIX = "-bf16reduce"


@dataclass(frozen=True)
class Precision:
    """How the model's parameters are held, stepped and reduced.

    Attributes:
        name: one of :data:`PRECISIONS`.
        reduce_dtype: with ``bf16-master`` only, and only for modes that let it be chosen
            (:attr:`shardopt.app.modes.Mode.reduce_dtypes`): the dtype gradients travel to
            their owner in, ``"fp32"`` or ``"bf16"``; ``None`` is the mode's default (fp32
            for zero2; DDP under zero1 all-reduces the bf16 gradients as they are).

    Raises:
        ValueError: an unknown name or reduce dtype, or a reduce dtype without
            ``bf16-master``.
    """

    name: str = "fp32"
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"Precision.name must be one of {', '.join(PRECISIONS)}, got {self.name!r}")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"Precision.reduce_dtype must be one of {', '.join(REDUCE_DTYPES)} or None, got "
                             f"{self.reduce_dtype!r}")
        if self.reduce_dtype is not None and self.name != "bf16-master":
            raise ValueError(f"Precision.reduce_dtype={self.reduce_dtype!r} needs name='bf16-master' (fp32 masters "
                             f"on the owner), got name={self.name!r}; leave reduce_dtype None")

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype the model's parameters are cast to before wrapping."""
        return torch.float32 if self.name == "fp32" else torch.bfloat16

    @property
    def master_dtype(self) -> torch.dtype | None:
        """``torch.float32`` when the owner keeps fp32 masters, else ``None``."""
        return torch.float32 if self.name == "bf16-master" else None

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The reduce dtype chosen with ``reduce_dtype``, or ``None`` for the mode's default."""
        return None if self.reduce_dtype is None else _DTYPES[self.reduce_dtype]

    @property
    def suffix(self) -> str:
        """What a bench mode name appends for this precision: ``""``, ``-bf16``, ``-bf16m``, ``-bf16m-bf16reduce``."""
        return _SUFFIXES[self.name] + (_REDUCE_SUFFIX if self.reduce_dtype == "bf16" else "")

    def describe(self) -> str:
        """One phrase for tables and help, e.g. ``"bf16 params + fp32 masters, bf16 reduce"``."""
        text = {"fp32": "fp32", "bf16": "bf16 params", "bf16-master": "bf16 params + fp32 masters"}[self.name]
        return text if self.reduce_dtype is None else f"{text}, {self.reduce_dtype} reduce"

    @staticmethod
    def split_name(run_name: str) -> tuple[str, Precision]:
        """Split a bench mode name such as ``zero2-bf16m-bf16reduce`` into ``("zero2", Precision(...))``.

        A name without a precision suffix is fp32. The base name is not checked here (see
        :func:`shardopt.app.modes.resolve`).

        Args:
            run_name: the name as given.

        Returns:
            The base mode name and the precision its suffix names.
        """
        base, reduce_dtype = run_name, None
        if base.endswith(_REDUCE_SUFFIX):
            base, reduce_dtype = base[: -len(_REDUCE_SUFFIX)], "bf16"
        for name in ("bf16-master", "bf16"):
            if base.endswith(_SUFFIXES[name]):
                return base[: -len(_SUFFIXES[name])], _from_suffixes(name, reduce_dtype, run_name)
        return base, _from_suffixes("fp32", reduce_dtype, run_name)


def _from_suffixes(name: str, reduce_dtype: str | None, run_name: str) -> Precision:
    if reduce_dtype is not None and name != "bf16-master":
        raise ValueError(f"mode {run_name!r}: {_REDUCE_SUFFIX} needs fp32 masters (a -bf16m name before it), e.g. "
                         "zero2-bf16m-bf16reduce")
    return Precision(name, reduce_dtype)
