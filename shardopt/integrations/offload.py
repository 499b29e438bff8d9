"""The ``offload`` option of the framework integrations, checked once for all of them.

Note [offload in the integrations]
DeepSpeed users turn on ZeRO-Offload with ``offload_optimizer: {device: cpu}`` (Lightning:
``strategy="deepspeed_stage_2_offload"``). Here the same choice is ``offload="cpu"`` on the
ZeRO-1/2 configuration of each integration (``ZeRO1Strategy``/``ZeRO2Strategy`` in
Lightning, ``Sharding`` in Hugging Face), which builds its :class:`~shardopt.optim.OSS` with
``offload="cpu"``: the owners' masters (an fp32 parameter's exact fp32 mirror), their
gradients and the wrapped optimizer's state live in host memory and are stepped there (Note
[offloaded masters] in :mod:`shardopt.optim.masters`). ``oss_kwargs={"offload": "cpu"}``
means the same (it is used when ``offload`` is left at ``None``); the two may not disagree. A
value is checked when the configuration is built, before any process group exists, with the
OSS's own rule (``None`` or ``"cpu"``). Checkpoints do not change with offload, so a run
saved with it resumes without it and the reverse. No ``shardopt_zero2_offload`` name is
registered: the shardopt strategies take their options as constructor arguments (one
registered name per class; in YAML, ``init_args``). Accelerate custom loops build their OSS
themselves, so there it is ``OSS(..., offload="cpu")``; the same holds for an OSS a user hands
to Lightning or the Trainer, which is used as built: one built without the ``offload`` its
configuration asks for is refused, not silently kept on the device. ZeRO-3 keeps no OSS, so ``offload``
there is refused rather than ignored: offloading a FullyShardedDataParallel model is not
built yet.

Note [delayed update in the integrations]
``oss_kwargs={"delay_update_after": k}`` with ``offload="cpu"`` builds the OSS with the delayed
parameter update (Note [delayed update] in :mod:`shardopt.optim.delayed_update`). The value is
checked with the configuration, against its resolved ``offload``, by the OSS's own rule, and the
error names the configuration and its fix. Three things must hold for a delayed OSS inside a
framework's loop, and the integrations see to them: its ``step()`` is called without a closure
(Lightning's ``"32-true"`` and ``"bf16-mixed"`` plugins pass theirs into ``step``; the shardopt
plugins run it first when the OSS delays, as they always do for ``"bf16-true"``); whatever reads the
model (a full checkpoint, validation, the end of training) comes after ``finish_update()``, which
writes the pending update (on every rank: it gathers); and a checkpoint carries the step count, so
a resumed run keeps its warm-up (Note [saved step count] there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shardopt.optim import OSS
from shardopt.optim.delayed_update import check_delay_update_after
from shardopt.optim.masters import check_offload

__all__ = ["check_given_oss", "refuse_zero3_offload", "resolve_offload"]


def resolve_offload(offload: object, oss_kwargs: Mapping[str, Any], owner: str) -> str | None:
    """The offload an integration's OSS is built with (Note [offload in the integrations]).

    Args:
        offload: the integration's ``offload`` argument.
        oss_kwargs: its ``oss_kwargs``, which may hold ``"offload"`` too.
        owner: the configuration's name for messages, e.g. ``"ZeRO2Strategy"``.

    Returns:
        ``offload``, else ``oss_kwargs["offload"]``, else ``None``: ``"cpu"`` or ``None``.

    Raises:
        ValueError: the two are both given and differ, or the value is neither ``None`` nor
            ``"cpu"`` (the OSS's rule); ``oss_kwargs["delay_update_after"]`` is negative or set
            without offload (Note [delayed update in the integrations]).
        TypeError: ``oss_kwargs["delay_update_after"]`` is neither ``None`` nor an int.
    """
    in_kwargs = oss_kwargs.get("offload")
    if offload is not None and "offload" in oss_kwargs and in_kwargs != offload:
        raise ValueError(f"{owner}(offload={offload!r}) disagrees with oss_kwargs={{'offload': {in_kwargs!r}}}; "
                         f"pass offload once, as {owner}(offload=...)")
    value = offload if offload is not None else in_kwargs
    try:
        host = check_offload(value)
    except ValueError as e:
        given = f"offload={value!r}" if offload is not None else f"oss_kwargs={{'offload': {value!r}}}"
        raise ValueError(f"{owner}({given}): {e}") from None
    _check_delay(oss_kwargs, host, owner)
    return None if host is None else host.type


def _check_delay(oss_kwargs: Mapping[str, Any], host: torch.device | None, owner: str) -> None:
    """Refuse ``oss_kwargs["delay_update_after"]`` as the OSS would, naming the configuration and its fix
    (Note [delayed update in the integrations])."""
    value = oss_kwargs.get("delay_update_after")
    given = f"{owner}(oss_kwargs={{'delay_update_after': {value!r}}})"
    try:
        check_delay_update_after(value, torch.device("cpu"))  # the value itself; the offload next
    except (TypeError, ValueError) as e:
        raise type(e)(f"{given}: {e}") from None
    if value is not None and host is None:
        raise ValueError(f"{given} needs offload='cpu': only a step in host memory runs in the background while "
                         f"the next iteration computes (docs/offload.md); pass {owner}(offload='cpu', "
                         f"oss_kwargs={{'delay_update_after': {value!r}}}), or drop delay_update_after")


def refuse_zero3_offload(offload: object, owner: str, instead: str, stage: str = "") -> None:
    """Refuse ``offload`` for ZeRO-3 (Note [offload in the integrations]).

    Args:
        offload: the ``offload`` argument given with ZeRO-3.
        owner: the configuration's name, e.g. ``"ZeRO3Strategy"``.
        instead: the ZeRO-2 configuration that offloads, e.g. ``"ZeRO2Strategy(offload='cpu')"``.
        stage: how the configuration chose ZeRO-3, written before ``offload`` in the
            message (``"stage=3, "`` for ``Sharding``; nothing for a ZeRO-3 class).

    Raises:
        ValueError: ``offload`` is not ``None``.
    """
    if offload is not None:
        raise ValueError(
            f"{owner}({stage}offload={offload!r}): ZeRO-3 offload is not available yet (offload keeps an OSS's masters and "
            "optimizer state in host memory, and ZeRO-3 shards with FullyShardedDataParallel, without an OSS); use "
            f"{instead} to keep the optimizer state and masters in host memory, or leave offload=None"
        )


def check_given_oss(optimizer: OSS, offload: str | None, owner: str) -> None:
    """Refuse an OSS the user built (used as it is) without the ``offload`` its integration
    asks for (Note [offload in the integrations]).

    Args:
        optimizer: the OSS the integration will step.
        offload: the integration's resolved ``offload`` (:func:`resolve_offload`).
        owner: the configuration's name, e.g. ``"ZeRO2Strategy"``.

    Raises:
        ValueError: ``offload`` is set and ``optimizer`` was built with another one.
    """
    if offload is not None and optimizer.offload != offload:
        raise ValueError(
            f"{owner}(offload={offload!r}) got an OSS built with offload={optimizer.offload!r}, which is used as it "
            f"was built; build it with OSS(..., offload={offload!r}), or hand over a plain torch.optim optimizer "
            f"(the integration rebuilds it as an OSS with offload={offload!r})"
        )
