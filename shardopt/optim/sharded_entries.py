"""OSS's state for a sharded checkpoint: each owner's fragments under flat string keys.

Note [fragment keys]
A rank writes the state of the rows it owns (Note [sharded optimizer layout] in
:mod:`shardopt.checkpoint`). A whole parameter's entry is keyed ``"<index>.<name>"``, as
before split ownership existed, so older checkpoints and unsplit ones read the same. A
block of a split parameter is keyed ``"<index>@<row start>-<row stop>.<name>"``: every
fragment once, and the rows it covers readable from the key alone. At load each rank asks
for the fragments that overlap the rows it owns under its own plan (another world size, or
split where the saver was not: a whole entry overlaps every block), then cuts and joins them
to its rows (Note [state rows] in :mod:`shardopt.optim.state_transport`). A rank reads at
most the fragments around its rows: one whole entry where the saver did not split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shardopt.optim.state_transport import Fragments, Rows, StateByIndex, assemble

__all__ = ["decode", "encode", "template"]


def _key(index: int, rows: Rows, whole: Rows, name: str) -> str:
    return f"{index}.{name}" if rows == whole else f"{index}@{rows[0]}-{rows[1]}.{name}"


def _parse(key: str, all_rows: Mapping[int, Rows]) -> tuple[int, Rows, str] | None:
    """(index, rows, name) of a key (Note [fragment keys]); None for an index this model lacks."""
    head, name = key.split(".", 1)
    index_text, _, rows_text = head.partition("@")
    index = int(index_text)
    if index not in all_rows:
        return None
    if not rows_text:
        return index, all_rows[index], name
    start, stop = rows_text.split("-")
    return index, (int(start), int(stop)), name


def encode(fragments: Fragments, whole_rows: tuple[int, ...]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's fragments as (tensors, other values) under their keys (Note [fragment keys])."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for (index, start, stop), entry in fragments.items():
        for name, value in entry.items():
            key = _key(index, (start, stop), (0, whole_rows[index]), name)
            (tensors if isinstance(value, torch.Tensor) else values)[key] = value
    return tensors, values


def _overlaps(rows: Rows, mine: Rows) -> bool:
    return rows == mine or max(rows[0], mine[0]) < min(rows[1], mine[1])


def template(saved: Mapping[str, tuple[torch.Size, torch.dtype]], owned: Mapping[int, Rows],
             whole_rows: tuple[int, ...], devices: Mapping[int, torch.device]) -> dict[str, torch.Tensor]:
    """Empty tensors for the ``saved`` keys whose rows overlap what this rank owns (``owned``).

    Raises:
        ValueError: the saved fragments of a parameter leave some of this rank's rows uncovered.
    """
    all_rows = {i: (0, r) for i, r in enumerate(whole_rows)}
    out: dict[str, torch.Tensor] = {}
    covered: dict[int, set[Rows]] = {}
    for key, (shape, dtype) in saved.items():
        parsed = _parse(key, all_rows)
        if parsed is not None and parsed[0] in owned and _overlaps(parsed[1], owned[parsed[0]]):
            out[key] = torch.empty(shape, dtype=dtype, device=devices[parsed[0]])
            covered.setdefault(parsed[0], set()).add(parsed[1])
    for index, found in covered.items():  # before anything is read: every owned row must be there
        start, stop = owned[index]
        for rows in sorted(found):
            if rows[0] > start:
                stop = min(stop, rows[0])  # the first gap
                break
            start = max(start, rows[1])
        if start < stop:
            raise ValueError(f"the checkpoint's optimizer state for parameter {index} does not cover rows "
                             f"[{start}, {stop}) that this rank owns (its fragments: {sorted(found)}); it was saved "
                             "from another model or is incomplete. Nothing was loaded")
    return out


def decode(tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any], owned: Mapping[int, Rows],
           whole_rows: tuple[int, ...]) -> StateByIndex:
    """The state of exactly this rank's rows from the loaded fragments (and every rank's values).

    Raises:
        ValueError: the fragments cover only part of a block this rank owns.
    """
    all_rows = {i: (0, r) for i, r in enumerate(whole_rows)}
    found: dict[tuple[int, int, int], dict[str, Any]] = {}
    for key, value in {**values, **tensors}.items():
        parsed = _parse(key, all_rows)
        if parsed is None or parsed[0] not in owned or not _overlaps(parsed[1], owned[parsed[0]]):
            continue
        index, rows, name = parsed
        found.setdefault((index, *rows), {})[name] = value
    return assemble([(i, (a, b), entry) for (i, a, b), entry in found.items()], owned)
