"""The redirect of torch's ``clip_grad_norm_`` (Note [clipping that bypasses the wrapper] in
shardopt.clipping) stays installed while any registered wrapper is alive, whatever the garbage
collector finalizes meanwhile."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import torch

from shardopt import clipping


class _Wrapper:
    """Stands for a ShardedDataParallel: any object clipping can hold weakly."""


def _redirected() -> bool:
    return clipping._installed is not None  # the redirect is in place


def test_an_old_wrappers_finalizer_during_a_registration_leaves_the_redirect_installed() -> None:
    gc.collect()  # wrappers an earlier test left in garbage cycles (a traceback's frames) would keep the redirect
    assert not _redirected(), "a live wrapper from another test is registered"
    old_params = [torch.nn.Parameter(torch.zeros(2))]
    old: list[_Wrapper] = [_Wrapper()]
    clipping.register_sharded(old[0], old_params, "Old.clip")
    clipping.unregister(old[0], old_params)  # closed, not yet collected: its finalizer is still armed
    assert not _redirected()
    new = _Wrapper()
    new_params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]

    def params_while_the_old_one_is_collected() -> Iterator[torch.nn.Parameter]:
        yield new_params[0]
        old.clear()  # the old wrapper dies mid-registration (a collection at that point did it in the
        gc.collect()  # two-optimizer recipe test); its finalizer runs now
        yield new_params[1]

    clipping.register_sharded(new, params_while_the_old_one_is_collected(), "New.clip")
    try:
        assert _redirected(), "torch's clip_grad_norm_ was restored under a live registered wrapper"
        assert all(clipping.sharded_by(p) is not None for p in new_params)
    finally:
        clipping.unregister(new, new_params)
    assert not _redirected()  # the last wrapper closed: torch's function is back
