"""``torch.compile`` over ``FullyShardedDataParallel``: the units' own steps never enter a graph.

Note [compiling FullyShardedDataParallel]
What went wrong. ``torch.compile(FullyShardedDataParallel(model, auto_wrap_policy=...))``
used to let Dynamo trace into the units' steps. Between its graph breaks (the collectives in
``comm``) it compiled the handle's ``p.data = view`` swaps (Note [flat parameter layout] in
``flat_param``) into graphs, which Dynamo lowers to ``Tensor.set_`` on the parameter
(``torch/_dynamo/variables/builtin.py``, the ``.data`` setattr branch). Two failures follow:

* an in-place op that eager never runs: eager ``.data`` assignment keeps the parameter's
  version counter, the traced ``set_`` bumps it. One compiled forward of the tiny GPT took
  the tied embedding weight from version 1 to 3 (full views in, shard views out), after
  AOT autograd had saved an alias of it for backward (``weight.t()``, "output 0 of
  AsStrided") at version 2, so aot_eager's backward stopped with "modified by an inplace
  operation ... is at version 3; expected version 2";
* Dynamo drops a parameter's shape guard when it traces an assignment to its ``.data``
  (the "Remove the old reference in tracked fakes" step there), so the graph compiled for a
  swap made with full-shaped parameters was replayed on shard-shaped ones; inductor's input
  check names the row counts of the two states: "expected size 4==8" on the root's 8-row
  ``pos`` held as 4 rows per rank (the report's "128==256": 256 rows, 128 per rank).

What it does now, as FSDP2 does (``_dynamo_disable`` on its hooks in
``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``): Dynamo skips the wrapper's own
``forward`` frame but still compiles the frames it calls (``recursive=False``), and never
traces the two steps around the wrapped module (``recursive=True``): entering (the root's
lazy setup, gather, inputs hooked) and leaving (outputs hooked, reshard or hold). So the
wrapped module's ``forward`` is compiled as a frame of its own, always with the full,
gathered parameters, and the swaps, collectives and hooks run eagerly as without compile.
The backward hooks are autograd hooks, never traced (compiled autograd is not covered).
Autograd's saved aliases of a parameter view the unit's full buffer, whose storage the
reshard frees and the next gather refills in place, so they are valid again when the
backward needs them.

Where the graphs are. A graph ends at every call of a unit: Dynamo graph-breaks in the
caller where it calls a ``FullyShardedDataParallel``. A transformer calling its block units
in a ``for`` loop cannot resume inside the loop, so Dynamo runs that frame (the root's
embedding, final norm and head) eagerly and compiles each block's ``forward``: one graph,
reused by every block of the same shapes (measured on the tests' GPT: 1 graph for 2 and for
10 blocks, no recompilation). Compiling each block in place (``block.compile()`` before
wrapping) gives the same graphs and leaves the root's frame alone; see docs/compile.md.
Dynamo cannot end a graph inside an activation-checkpointed region either, so a unit inside
one leaves the region uncompiled (eager, correct): the units must enclose the checkpointed
blocks. With ``fullgraph=True`` a unit inside the compiled code is an error at the first
forward, whose message (the reason given to ``torch.compiler.disable``) names the recipe.

Why at the first construction and not at import: ``torch.compiler.disable`` imports
``torch._dynamo``, about a second on the CPUs measured, which ``import shardopt`` should not
pay. Nothing can be compiling a wrapper before one exists (and a training process imports
``torch._dynamo`` at its first optimizer step anyway).
"""

from __future__ import annotations

import torch

__all__ = ["keep_out_of_graphs"]

_REASON = ("a FullyShardedDataParallel unit ends the graph: its gather, reshard and hooks run eagerly, so "
           "torch.compile(..., fullgraph=True) cannot span units; compile each unit's module instead, e.g. "
           "block.compile() on every block before wrapping (shardopt's docs/compile.md)")


def keep_out_of_graphs(cls: type, frame: str, steps: tuple[str, ...]) -> None:
    """Let ``torch.compile`` compile what ``cls.<frame>`` calls, but never ``frame`` itself
    nor the ``steps`` methods (Note [compiling FullyShardedDataParallel]). Once per class;
    later calls return at once.

    Args:
        cls: the class whose methods change (its own attributes, not inherited ones).
        frame: the method Dynamo skips while still compiling the frames it calls.
        steps: the methods Dynamo never traces, nor anything they call.
    """
    if cls.__dict__.get("_shardopt_out_of_graphs", False):
        return
    for name in steps:
        setattr(cls, name, torch.compiler.disable(cls.__dict__[name], recursive=True, reason=_REASON))
    setattr(cls, frame, torch.compiler.disable(cls.__dict__[frame], recursive=False, reason=_REASON))
    cls._shardopt_out_of_graphs = True  # type: ignore[attr-defined]
