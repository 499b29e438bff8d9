"""torch.compile and activation checkpointing at every ZeRO stage train like DDP doing the same.

ZeRO-1 (OSS under DDP), ZeRO-2 (OSS + ShardedDataParallel) and ZeRO-3
(FullyShardedDataParallel, a unit per block) each run every habit of
:data:`tests.helpers.compile_habits.HABITS` (activation checkpointing, reentrant or not,
under compile; ``torch.compile(model)`` before wrapping; ``block.compile()`` on every block;
``torch.compile(wrapper)``) for 4 steps at 2 ranks, and DDP runs the same habit on the same
seeded model and data. One process group per stage sweeps the habits.

Where the result is bitwise DDP's, and why:

* aot_eager, every stage and habit: aot_eager runs eager's aten kernels one at a time, so
  the arithmetic does not depend on where the graphs start and end; each stage's reduction
  is DDP's at 2 ranks (``g * (1/2)`` summed, fp32 sums of two terms commute; Note [average
  like DDP] in shardopt.nn.fsdp.unit) and OSS steps each element as torch's Adam does.
* inductor, where the stage compiles the same graphs as DDP: ZeRO-1 is DDP; ZeRO-2's
  wrapper is traced through into the same graph as DDP's; ZeRO-3 compiles exactly the
  blocks when the blocks are compiled (and, with checkpointing, when the units enclose the
  checkpointed blocks). Same graphs, same generated kernels, same bits.

Elsewhere inductor generates other kernels for ZeRO-3 than for DDP: ``torch.compile`` of
the wrapper (or of the model before wrapping) compiles the blocks' forwards only, since a
graph ends at every unit and Dynamo runs the frame that calls the units in a loop eagerly
(Note [compiling FullyShardedDataParallel] in shardopt.nn.fsdp.compiling), while DDP's is
one graph of the whole model. There the runs step SGD instead of Adam (Adam's update
``m / sqrt(v)`` turns a rounding difference in a near-zero gradient into up to ``lr``,
whatever its size, so no useful bound exists) with the tolerance of :func:`_sgd_tolerance`,
and ZeRO-3 is also compared bit for bit with DDP compiling the blocks. The same holds for
ZeRO-3 with units inside checkpointed blocks, which runs those blocks eagerly (:func:`_graphs`).

The default run sweeps every habit on aot_eager and the per-block recipe (and ZeRO-3's
compiled wrapper) on inductor; the rest of inductor, minutes of compiling on a small CPU,
is marked slow (``pytest --run-slow``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn.fsdp import FullyShardedDataParallel as FSDP
from shardopt.nn.fsdp import ModuleClassPolicy
from shardopt.testing import run_ranks
from tests.helpers.compile_habits import (HABITS, SGD_LR, STEPS, UNITS_AROUND_CHECKPOINTS, GraphCount, Habit, Run,
                                          max_diff, run)
from tests.helpers.data import max_abs_diff
from tests.helpers.gpt import Block, gpt, lm_loss, tokens

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

PER_BLOCK = next(h for h in HABITS if h.name == "compile per block")
WRAPPER = next(h for h in HABITS if h.name == "compile the wrapper")
ALL_HABITS = [*HABITS, UNITS_AROUND_CHECKPOINTS]
TIMEOUT_S = 900.0  # a cold inductor compile of the tiny GPT takes about a minute on 2 shared cores


@dataclass(frozen=True)
class Case:
    """One habit on one backend, against DDP doing ``against`` (the same habit by default)."""

    habit: Habit
    backend: str
    against: Habit | None = None

    @property
    def key(self) -> str:
        return f"{self.habit.name}/{self.backend}" + (f" vs DDP {self.against.name}" if self.against else "")


def _same_graphs(stage: str, case: Case) -> bool:
    """Whether the stage runs DDP's arithmetic in this case (the module docstring's cases)."""
    habit = case.habit
    if case.backend != "inductor" or stage in ("zero1", "zero2"):
        return True
    if case.against is PER_BLOCK:  # ZeRO-3 compiles the blocks whatever compiles the model
        return habit.checkpoint is None
    return habit.compile == "per-block" and (habit.checkpoint is None or habit.units_around_checkpoints)


def _sgd_tolerance(ref: Run) -> float:
    """How far two fp32 SGD runs of different inductor kernels for the same model may drift.

    Each gradient element is a sum of products over the batch and the two blocks; evaluating
    it in another order (inductor fuses and reassociates) changes it by at most a few units
    of fp32 rounding (u = 2**-24) per operation on the path, times the sum of the terms'
    magnitudes. Allowing 2**10 such units (the path's length times a cancellation factor of
    16) bounds it by ``2**-14 * grad_scale``. An SGD step moves a parameter by ``lr * g`` and
    rounds once more (half an ulp of the parameter, ``2**-24 * param_scale``), and the
    second-order effect of the already-different parameters on the next gradient is far
    smaller over 4 steps. So the parameters differ by at most
    ``STEPS * (lr * 2**-14 * grad_scale + 2**-24 * param_scale)``: 4.1e-5 here (1.2e-7
    measured), while a gradient left unaveraged or a step on stale parameters moves the
    largest of them by about ``lr * grad_scale``, 0.16 here.
    """
    return STEPS * (SGD_LR * 2**-14 * ref.grad_scale + 2**-24 * ref.param_scale)


def _sweep(rank: int, world_size: int, stage: str, cases: list[Case]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in cases:
        started = time.monotonic()
        exact = _same_graphs(stage, case)  # else SGD: see the module docstring
        mine = run(stage, case.habit, case.backend, rank, sgd=not exact)
        ref = run("ddp", case.against or case.habit, case.backend, rank, sgd=not exact)
        r = out[case.key] = {"exact": exact, "diff": max_diff(mine, ref), "graphs": mine.graphs}
        if not exact:
            r["tol"] = _sgd_tolerance(ref)
            if stage == "zero3" and case.habit.checkpoint is None:  # what ZeRO-3 compiles: the blocks
                r["diff_to_ddp_compiling_blocks"] = max_diff(mine, run("ddp", PER_BLOCK, case.backend, rank, sgd=True))
        r["s"] = round(time.monotonic() - started, 1)
    return out


def _graphs(stage: str, habit: Habit) -> int:
    """How many graphs the stage's run compiles (the same on aot_eager and inductor).

    One graph of the block's forward for both blocks (the same code and shapes), or of the
    whole model when DDP's or ShardedDataParallel's forward is compiled; ShardedDataParallel's
    forward checks every ``p.grad`` first, so the runs that alternate
    ``zero_grad(set_to_none=True/False)`` compile it once with and once without gradients.
    ZeRO-3 with units inside the checkpointed blocks compiles nothing: Dynamo cannot end a
    graph inside a checkpoint (a unit's call would), so it runs the checkpointed blocks
    eagerly, correct but not compiled; units around the checkpointed blocks are the recipe
    (Note [compiling FullyShardedDataParallel] in shardopt.nn.fsdp.compiling).
    """
    if stage == "zero3" and habit.checkpoint is not None and not habit.units_around_checkpoints:
        return 0
    return 2 if stage == "zero2" and habit.compile == "wrapper" else 1


def _check(stage: str, cases: list[Case]) -> None:
    results = run_ranks(_sweep, 2, stage, cases, timeout_s=TIMEOUT_S)
    for out in results:
        for case in cases:
            r = out[case.key]
            if r["exact"]:
                assert r["diff"] == 0.0, (stage, case.key, r)
            else:
                assert r["diff"] <= r["tol"], (stage, case.key, r)
                assert r.get("diff_to_ddp_compiling_blocks", 0.0) == 0.0, (stage, case.key, r)
            assert r["graphs"] == _graphs(stage, case.habit), (stage, case.key, r)
    print(f"{stage}: (seconds, max diff) per case", {k: (v["s"], v["diff"]) for k, v in results[0].items()})


def _habits(stage: str) -> list[Habit]:
    return ALL_HABITS if stage == "zero3" else list(HABITS)


def _default_cases(stage: str) -> list[Case]:
    """Every habit on aot_eager; on inductor the per-block recipe and, for ZeRO-3, the
    compiled wrapper against DDP compiling the same blocks (cached graphs, bitwise)."""
    inductor = [Case(PER_BLOCK, "inductor")]
    if stage == "zero3":
        inductor.append(Case(WRAPPER, "inductor", against=PER_BLOCK))
    return [Case(h, "aot_eager") for h in _habits(stage)] + inductor


def _slow_cases(stage: str) -> list[Case]:
    """Every habit on inductor against DDP doing the same, but the default run's."""
    return [Case(h, "inductor") for h in _habits(stage) if h is not PER_BLOCK]


@pytest.mark.timeout(int(TIMEOUT_S) + 60)
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_compile_and_checkpoint_habits_train_like_ddp_doing_the_same(stage: str) -> None:
    _check(stage, _default_cases(stage))


@pytest.mark.slow
@pytest.mark.timeout(int(TIMEOUT_S) + 60)
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_every_habit_on_inductor_trains_like_ddp_doing_the_same(stage: str) -> None:
    _check(stage, _slow_cases(stage))


def _train_eagerly_or_compiled(wrapper: torch.nn.Module, rank: int, fullgraph: bool | None) -> tuple[list[Any], int]:
    """STEPS Adam steps; compiled on aot_eager unless ``fullgraph`` is None. The state and the graph count."""
    torch._dynamo.reset()
    count = GraphCount("aot_eager")
    call = wrapper if fullgraph is None else torch.compile(wrapper, backend=count, fullgraph=fullgraph)
    opt = torch.optim.Adam(wrapper.parameters(), lr=1e-2)
    for step in range(STEPS):
        toks = tokens(rank, step)
        opt.zero_grad()
        lm_loss(call(toks), toks).backward()
        opt.step()
    state = (wrapper if isinstance(wrapper, FSDP) else wrapper.get_submodule("module")).state_dict()
    return [v.detach().clone() for v in state.values()], len(count.graphs)


def _fullgraph(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch._dynamo.reset()
    model = FSDP(gpt(), auto_wrap_policy=ModuleClassPolicy((Block,)))
    with pytest.raises(Exception) as info:  # torch._dynamo.exc.Unsupported
        torch.compile(model, backend="aot_eager", fullgraph=True)(tokens(rank, 0))
    out["refused"] = str(info.value)
    # nothing lost: the same model then trains as DDP does
    out["diff_after"] = max_abs_diff(_train_eagerly_or_compiled(model, rank, None)[0],
                                     _train_eagerly_or_compiled(DDP(gpt()), rank, None)[0])
    # one unit: the wrapped model is one graph, so fullgraph holds, and it trains like DDP
    # compiled (DDP's own forward graph-breaks, so not with fullgraph)
    mine, graphs = _train_eagerly_or_compiled(FSDP(gpt()), rank, True)
    out["diff_one_unit"] = max_abs_diff(mine, _train_eagerly_or_compiled(DDP(gpt()), rank, False)[0])
    out["graphs"] = graphs
    return out


def test_fullgraph_across_units_is_refused_at_the_first_forward_naming_the_per_block_recipe() -> None:
    for out in run_ranks(_fullgraph, 2, timeout_s=TIMEOUT_S):
        assert "a FullyShardedDataParallel unit ends the graph" in out["refused"], out["refused"]
        assert "fullgraph=True) cannot span units" in out["refused"] and "block.compile()" in out["refused"]
        assert out["diff_after"] == 0.0, out
        assert out["diff_one_unit"] == 0.0 and out["graphs"] == 1, out
