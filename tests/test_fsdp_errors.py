"""Every user mistake FullyShardedDataParallel detects ends in a clear error (or warning)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardopt.nn.fsdp import FullyShardedDataParallel as FSDP
from shardopt.nn.fsdp import MixedPrecision, ModuleClassPolicy, NameGlobPolicy, ShardingStrategy
from shardopt.testing import run_ranks
from tests.helpers.data import rank_batch, seeded_mlp
from tests.helpers.gpt import Block, gpt, lm_loss, tokens

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)


def _message(fn: Callable[[], Any], kind: type[BaseException]) -> str:
    try:
        fn()
    except kind as exc:
        return str(exc)
    raise AssertionError(f"{fn} did not raise {kind.__name__}")


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4).double()


class _Scaled(nn.Module):
    """Tensors of its own and no reset_parameters(): to_empty() alone would leave them garbage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("pe", torch.arange(4.0))
        self.lin_weight = self.lin.weight  # tied to the Linear, whose reset_parameters() covers it


class _Box:
    """An output FSDP cannot look into (not a tensor, container or dataclass)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _BoxedOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> _Box:
        return _Box(self.lin(x))


def _errors(rank: int, world_size: int) -> dict[str, str]:
    m: dict[str, str] = {}
    wrapped = FSDP(seeded_mlp())
    m["double_wrap"] = _message(lambda: FSDP(wrapped), ValueError)
    m["not_module"] = _message(lambda: FSDP("model"), TypeError)  # type: ignore[arg-type]
    m["policy"] = _message(lambda: FSDP(seeded_mlp(), auto_wrap_policy=5), TypeError)  # type: ignore[arg-type]
    m["strategy"] = _message(lambda: FSDP(seeded_mlp(), sharding_strategy="FULL_SHARD"), TypeError)  # type: ignore[arg-type]
    m["mp_type"] = _message(lambda: FSDP(seeded_mlp(), mixed_precision=torch.bfloat16), TypeError)  # type: ignore[arg-type]
    m["mp_dtype"] = _message(lambda: MixedPrecision(param_dtype=torch.int8), TypeError)
    m["prefetch"] = _message(lambda: FSDP(seeded_mlp(), backward_prefetch="pre"), TypeError)  # type: ignore[arg-type]
    m["hybrid_groups"] = _message(lambda: FSDP(seeded_mlp(), sharding_strategy=ShardingStrategy.HYBRID_SHARD), ValueError)
    pair = (dist.new_group([0]), dist.new_group([0]))
    m["pair_not_hybrid"] = _message(lambda: FSDP(seeded_mlp(), process_group=pair), ValueError)
    m["dtypes"] = _message(lambda: FSDP(_Pair()), TypeError)
    # a tied weight split over units wrapped by hand
    model = gpt()
    model.embed = FSDP(model.embed)  # type: ignore[assignment]
    m["tied_by_hand"] = _message(lambda: FSDP(model), ValueError)
    # meta tensors left by a param_init_fn that does nothing
    with torch.device("meta"):
        meta = seeded_mlp()
    m["meta_left"] = _message(lambda: FSDP(meta, param_init_fn=lambda mod: None), ValueError)
    # meta tensors that only reset_parameters() could initialise, on modules without one
    with torch.device("meta"):
        scaled = nn.Sequential(nn.Linear(4, 4), _Scaled())
    m["meta_no_reset"] = _message(lambda: FSDP(scaled), ValueError)

    def init(mod: nn.Module) -> None:
        mod.to_empty(device="cpu")
        with torch.no_grad():
            for t in [*mod.parameters(), *mod.buffers()]:
                t.fill_(0.5)

    initialised = FSDP(scaled, param_init_fn=init).state_dict().values()
    m["meta_init_fn_accepted"] = str(all(bool((t == 0.5).all()) for t in initialised))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(seeded_mlp(), param_init_fn=lambda mod: None)
    m["init_fn_ignored"] = " ".join(str(w.message) for w in caught)
    # misuse at run time
    root = FSDP(gpt(), auto_wrap_policy=ModuleClassPolicy((Block,)))
    toks = tokens(rank, 0)
    lm_loss(root(toks), toks).backward()
    nested = root.module.blocks[0]
    m["nested_no_sync"] = _message(lambda: nested.no_sync().__enter__(), ValueError)
    m["nested_clip"] = _message(lambda: nested.clip_grad_norm_(1.0), ValueError)
    m["nested_sharded_sd"] = _message(lambda: nested.sharded_state_dict(), ValueError)
    m["clip_args"] = _message(lambda: root.clip_grad_norm_(0.0), ValueError)
    m["rank0_writeback"] = _message(lambda: root.summon_full_params(rank0_only=True).__enter__(), ValueError)

    def forward_inside_summon() -> None:
        with root.summon_full_params():
            root(toks)

    m["forward_in_summon"] = _message(forward_inside_summon, ValueError)
    m["assign"] = _message(lambda: root.load_state_dict(root.state_dict(), assign=True), ValueError)
    sharded = root.sharded_state_dict()
    sharded.pop("pos")
    m["sharded_missing"] = _message(lambda: root.load_sharded_state_dict(sharded), ValueError)
    # Another wrapping holds the same rows of every parameter (Note [flat parameter layout]):
    # its sharded state dict loads; an entry of another parameter's size is refused.
    other = FSDP(gpt(), auto_wrap_policy=ModuleClassPolicy((nn.Linear,)))
    root.load_sharded_state_dict(other.sharded_state_dict())
    mixed = other.sharded_state_dict()
    mixed["embed.weight"] = mixed["pos"]
    try:
        root.load_sharded_state_dict(mixed)
        m["sharded_layout"] = ""
    except ValueError as exc:
        m["sharded_layout"] = str(exc)
    boxed = FSDP(_BoxedOutput())
    boxed(rank_batch(rank, 0)).tensor.sum().backward()
    m["unseen_backward"] = _message(lambda: boxed(rank_batch(rank, 1)), ValueError)
    m["unreduced_grads"] = _message(boxed.state_dict, ValueError)  # instead of dropping them
    # optimizer state
    opt = torch.optim.Adam(list(root.parameters()) + [nn.Parameter(torch.zeros(3))])
    m["foreign_param"] = _message(lambda: FSDP.full_optim_state_dict(root, opt), ValueError)
    opt = torch.optim.Adam(root.parameters())
    m["not_osd"] = _message(lambda: FSDP.shard_full_optim_state_dict({}, root, opt), ValueError)
    two_groups = torch.optim.Adam([{"params": list(root.parameters())[:2]}, {"params": list(root.parameters())[2:]}])
    osd = FSDP.full_optim_state_dict(root, opt, rank0_only=False)
    m["groups"] = _message(lambda: FSDP.shard_full_optim_state_dict(osd, root, two_groups), ValueError)
    osd_missing = {**osd, "param_groups": [{**osd["param_groups"][0], "params": osd["param_groups"][0]["params"][1:]}]}
    m["name_missing"] = _message(lambda: FSDP.shard_full_optim_state_dict(osd_missing, root, opt), ValueError)
    # a state-key mismatch: only rank 0 steps before consolidating
    if rank == 0:
        opt.step()
    m["keys_differ"] = _message(lambda: FSDP.full_optim_state_dict(root, opt), ValueError)
    return m


EXPECTED = {
    "double_wrap": "already a FullyShardedDataParallel",
    "not_module": "must be a torch.nn.Module",
    "policy": "auto_wrap_policy must be callable",
    "strategy": "sharding_strategy must be a ShardingStrategy",
    "mp_type": "mixed_precision must be a MixedPrecision",
    "mp_dtype": "MixedPrecision.param_dtype must be a floating point",
    "prefetch": "backward_prefetch must be a BackwardPrefetch",
    "hybrid_groups": "HYBRID_SHARD needs process_group=(shard_group, replicate_group)",
    "pair_not_hybrid": "only meaningful with HYBRID_SHARD",
    "dtypes": "must share one dtype and device",
    "tied_by_hand": "parameter 'head.weight' is owned by FullyShardedDataParallel unit",
    "meta_left": "still on the meta device",
    "meta_no_reset": "these tensors are on the meta device in modules without reset_parameters(): ['1.scale', "
                     "'1.pe'] (in _Scaled); without param_init_fn, FullyShardedDataParallel materialises with "
                     "to_empty(), which would leave them holding arbitrary memory (Note [meta tensors nothing "
                     "initialises]). Pass param_init_fn=fn that materialises and initialises them (fn gets the whole "
                     "module), or give _Scaled a reset_parameters()",
    "meta_init_fn_accepted": "True",
    "init_fn_ignored": "param_init_fn is ignored",
    "nested_no_sync": "no_sync() must be called on the root",
    "nested_clip": "clip_grad_norm_() must be called on the root",
    "nested_sharded_sd": "sharded_state_dict() must be called on the root",
    "clip_args": "max_norm > 0",
    "rank0_writeback": "pass writeback=False",
    "forward_in_summon": "inside summon_full_params",
    "assign": "use assign=False",
    "sharded_missing": "the sharded state dict lacks ['pos']",
    "unseen_backward": "without reaching FSDP's hooks",
    "unreduced_grads": "holds gradients that were never reduced",
    "name_missing": "is not in the matching param group",
    "foreign_param": "not one of the model's parameters",
    "not_osd": "must be the dict returned by full_optim_state_dict",
    "groups": "param groups",
    "keys_differ": "ranks hold different optimizer state keys",
}


def test_user_mistakes_raise_errors_that_say_what_to_do() -> None:
    results = run_ranks(_errors, 2)
    for messages in results:
        for key, fragment in EXPECTED.items():
            assert fragment in messages[key], (key, messages[key])
    # the swapped entry's piece has another size on at least one rank
    assert any("use this model's own sharded_state_dict()" in m["sharded_layout"] for m in results), results


def test_fsdp_without_a_process_group_says_how_to_start_one() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        FSDP(seeded_mlp())


def test_module_class_policy_takes_a_set_a_list_or_one_class_and_refuses_anything_else() -> None:
    assert ModuleClassPolicy({Block, nn.Embedding}) == ModuleClassPolicy((nn.Embedding, Block))  # sorted: same on every rank
    assert ModuleClassPolicy(Block).classes == (Block,) == ModuleClassPolicy([Block, Block]).classes
    fix = "; pass the classes themselves, e.g. ModuleClassPolicy({Block}) or ModuleClassPolicy((Block, nn.Embedding))"
    for bad, shown in [("Block", "the string 'Block' (a name, not the class)"), ({nn.Linear(2, 2)}, "an instance of Linear"),
                       ((Block, int), "<class 'int'>"), (5, "5")]:
        with pytest.raises(TypeError) as info:
            ModuleClassPolicy(bad)  # type: ignore[arg-type]
        assert str(info.value) == f"ModuleClassPolicy takes nn.Module subclasses, got {shown}{fix}"
    with pytest.raises(ValueError, match=r"ModuleClassPolicy got no classes, so it would wrap nothing .* or "
                       r"auto_wrap_policy=None"):
        ModuleClassPolicy(set())
    assert NameGlobPolicy("blocks.*").patterns == ("blocks.*",)  # one pattern, not eight one-letter ones
    with pytest.raises(TypeError, match=r"NameGlobPolicy takes fnmatch patterns as strings, got 3; pass e.g."):
        NameGlobPolicy(("blocks.*", 3))  # type: ignore[arg-type]


def _policy_forms(rank: int, world_size: int) -> dict[str, list[str]]:
    units: dict[str, list[str]] = {}
    for form, policy in {"tuple": ModuleClassPolicy((Block,)), "set": ModuleClassPolicy({Block}),
                         "class": ModuleClassPolicy(Block)}.items():
        root = FSDP(gpt(), auto_wrap_policy=policy)
        toks = tokens(rank, 0)
        lm_loss(root(toks), toks).backward()  # the first forward failed with a set before
        units[form] = [name for name, m in root.named_modules() if isinstance(m, FSDP)]
    return units


def test_module_class_policy_given_a_set_wraps_the_same_units_as_a_tuple() -> None:
    (units,) = run_ranks(_policy_forms, 1, timeout_s=60)
    assert units["tuple"] == units["set"] == units["class"], units
    assert len(units["tuple"]) > 1, units  # the blocks are units of their own
