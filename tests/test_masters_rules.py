"""The master-weight rules that need no process: which parameters get a master, the
dtype checks and their messages, the shape rule for saved masters, and the fp32 no_sync
sums. (The distributed behaviour is in test_oss_masters.py and test_sharded_ddp_masters.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardopt.nn.data_parallel.local_sums import LocalSums
from shardopt.optim.masters import check_master_dtype, needs_master
from shardopt.state_checks import MASTER_KEY, entry_fits

F32, BF16 = torch.float32, torch.bfloat16


def test_needs_master_is_a_rule_on_dtypes() -> None:
    assert needs_master(BF16, F32) and needs_master(torch.float16, F32) and needs_master(F32, torch.float64)
    assert not needs_master(F32, F32) and not needs_master(BF16, None) and not needs_master(torch.int64, F32)
    assert not needs_master(torch.float16, BF16)  # as wide, another format: refused by check_master_dtype


def test_check_master_dtype_names_argument_value_rule_and_fix() -> None:
    bf16 = [nn.Parameter(torch.zeros(2, 3, dtype=BF16))]
    with pytest.raises(TypeError, match=r"master_dtype must be a torch.dtype such as torch.float32, got str "
                                        r"'float32'; pass OSS\(\.\.\., master_dtype=torch.float32\)"):
        check_master_dtype("float32", bf16)
    with pytest.raises(ValueError, match=r"master_dtype must be a floating dtype, got torch.int32; .*pass "
                                         r"master_dtype=torch.float32"):
        check_master_dtype(torch.int32, bf16)
    with pytest.raises(ValueError, match=r"master_dtype=torch.float16 cannot hold parameter 0 \(shape \(2, 3\), "
                                         r"dtype torch.bfloat16\): a master must be wider than its parameter"):
        check_master_dtype(torch.float16, bf16)
    assert check_master_dtype(F32, bf16) and not check_master_dtype(F32, [nn.Parameter(torch.zeros(2))])
    assert not check_master_dtype(None, bf16)


def test_saved_master_must_have_its_parameters_exact_shape() -> None:
    shape = torch.Size([16, 8])
    assert entry_fits(MASTER_KEY, torch.zeros(16, 8), shape)
    assert not entry_fits(MASTER_KEY, torch.zeros(16, 1), shape)  # fine for factored state, not a master
    assert entry_fits("exp_avg_sq_row", torch.zeros(16, 1), shape)
    assert not entry_fits(MASTER_KEY, torch.zeros(16, 8, dtype=torch.int32), shape)
    assert not entry_fits(MASTER_KEY, 3.0, shape)


def test_no_sync_sums_are_kept_in_fp32_and_free_the_low_precision_grad() -> None:
    p = nn.Parameter(torch.zeros(4, dtype=BF16))
    other = nn.Parameter(torch.zeros(4))
    sums = LocalSums({BF16: F32})
    tiny = torch.full((4,), 2.0**-9, dtype=BF16)  # below bf16's resolution at 1.0
    p.grad = torch.ones(4, dtype=BF16)
    sums.keep(p)
    for _ in range(4):
        p.grad = tiny.clone()
        sums.keep(p)
    other.grad = torch.ones(4)
    sums.keep(other)  # another dtype: left in .grad
    assert p.grad is None and other.grad is not None and len(sums) == 1  # keep() frees; ShardedDataParallel leaves a placeholder
    total = sums.take(p, torch.ones(4, dtype=BF16))
    assert total is not None and total.dtype == F32
    assert torch.equal(total, torch.full((4,), 2.0 + 4 * 2.0**-9))  # bf16 sums would have lost the 2**-9s
    assert len(sums) == 0 and sums.take(p, None) is None


def test_a_placeholder_says_whether_the_held_gradient_still_stands() -> None:
    """Note [placeholders for moved gradients]: untouched -> stands; dropped, zeroed in place
    or replaced -> discarded; every check removes the placeholder."""
    from shardopt.optim.masters import is_placeholder, leave_placeholder, take_placeholder

    p = nn.Parameter(torch.ones(3, 4, dtype=BF16))
    assert take_placeholder(p)  # nothing left: nothing to say
    for what, touch, stands in [
        ("untouched", lambda: None, True),
        ("set to None", lambda: setattr(p, "grad", None), False),
        ("zeroed in place", lambda: p.grad.zero_(), False),  # type: ignore[union-attr]
        ("module zero_grad(set_to_none=False)", lambda: nn.ParameterList([p]).zero_grad(set_to_none=False), False),
        ("replaced", lambda: setattr(p, "grad", torch.ones(3, 4, dtype=BF16)), False),
    ]:
        p.grad = None
        leave_placeholder(p)
        assert is_placeholder(p) and p.grad is not None and p.grad.untyped_storage().nbytes() == 2, what
        leave_placeholder(p)  # one placeholder stands for everything held
        touch()
        assert take_placeholder(p) is stands, what
        assert p.grad is None or not is_placeholder(p), what
        assert take_placeholder(p), what  # the check consumed it


def test_a_taken_placeholder_nobody_wrote_to_is_left_again_and_a_written_or_stale_one_is_not() -> None:
    """ShardedDataParallel leaves and takes a placeholder per owned parameter per backward pass:
    the same unwritten one is left again; one zeroed in place, or one of another dtype (the module
    was cast since), is replaced by a new one, and the checks still say what they said."""
    from shardopt.optim.masters import is_placeholder, leave_placeholder, take_placeholder

    p = nn.Parameter(torch.ones(3, 4, dtype=BF16))
    leave_placeholder(p)
    first = p.grad
    assert take_placeholder(p) and p.grad is None
    leave_placeholder(p)
    assert p.grad is first and is_placeholder(p)  # left again
    p.grad.zero_()  # type: ignore[union-attr]  # zero_grad(set_to_none=False): the held gradient is discarded
    assert not take_placeholder(p)
    leave_placeholder(p)
    second = p.grad
    assert second is not first and is_placeholder(p) and take_placeholder(p)
    nn.ParameterList([p]).to(torch.float16)
    leave_placeholder(p)
    assert p.grad is not second and p.grad.dtype == torch.float16 and is_placeholder(p)  # type: ignore[union-attr]
    assert take_placeholder(p) and take_placeholder(p)
    from shardopt import placeholders
    kept = len(placeholders._placeholders)
    del p
    assert len(placeholders._placeholders) == kept - 1  # nothing kept for a parameter that died
