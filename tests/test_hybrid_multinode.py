"""A real multi-node launch on one machine: two torchrun agents, 2 nodes of 2 ranks, gloo.

Each worker resolves one shard group per node (``shard_size = LOCAL_WORLD_SIZE``) and trains
hybrid ZeRO-1 (OSS over the node's shard group under DDP over the world), flat ZeRO-2
(ShardedDataParallel + OSS over the world) and hybrid ZeRO-2 (ShardedDataParallel + OSS with
``shard_size`` = ranks per node: reduced inside the node, then across the two nodes) next to
DDP + Adam; the verdict file must show
each shard group inside one node (one agent, one ``GROUP_RANK``), hybrid ZeRO-1 equal to DDP
bit for bit, and flat ZeRO-2 equal bit for bit to the rank-order reference its owners'
arithmetic follows (within 1e-6 relative of DDP, whose gloo ring sums the 4 terms in another
order; ``BOUNDS`` in tests/helpers/multinode_train.py), and hybrid ZeRO-2 equal bit for bit
to the reference that sums inside each node, then across nodes. The launch is bounded: on a timeout both
agents and their workers are stopped and the failure shows their output tails.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.helpers.multinode import REPO, AgentsFailed, launch_nodes
from tests.helpers.processes import session_processes

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

SCRIPT = REPO / "tests" / "helpers" / "multinode_train.py"


def test_two_torchrun_agents_give_node_shard_groups_hybrid_zero1_equal_to_ddp_and_hybrid_zero2_to_its_reference(
        tmp_path: Path) -> None:
    out = tmp_path / "verdict.json"
    run = launch_nodes(SCRIPT, ["--out", str(out), "--modes", "hybrid_zero1,flat_zero2,hybrid_zero2", "--steps", "5"],
                       nnodes=2, nproc_per_node=2, timeout_s=120)
    tail = "\n".join(o[-2000:] for o in run.outputs)
    assert out.exists(), f"rank 0 wrote no verdict; agents' output:\n{tail}"
    verdict = json.loads(out.read_text())
    print(f"\n2 agents x 2 workers finished in {run.wall_s:.1f} s")
    for r in verdict["reports"]:
        print(f"  rank {r['rank']}: node {r['group_rank']} (agent pid {r['agent_pid']}) local rank {r['local_rank']}"
              f" shard group {r['shard_ranks']} max|diff| vs DDP {r['max_abs_diff']}")
    assert verdict["ok"], f"{verdict['problems']}\nagents' output:\n{tail}"
    reports = verdict["reports"]
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    for r in reports:  # torchrun numbers ranks node by node; the shard group is the node
        assert r["local_world_size"] == 2 and r["rank"] == 2 * r["group_rank"] + r["local_rank"], r
        assert r["shard_ranks"] == [2 * r["group_rank"], 2 * r["group_rank"] + 1], r
        assert set(r["max_abs_diff"]) == {"hybrid_zero1", "flat_zero2", "hybrid_zero2"}, r
    assert reports[0]["agent_pid"] == reports[1]["agent_pid"] != reports[2]["agent_pid"] == reports[3]["agent_pid"]


def test_a_hanging_worker_stops_both_agents_at_the_timeout_with_their_output_tails(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text("import os, time\nprint('worker', os.environ['RANK'], 'waits forever', flush=True)\n"
                      "time.sleep(600)\n")
    started = time.monotonic()
    with pytest.raises(AgentsFailed) as caught:
        launch_nodes(script, [], nnodes=2, nproc_per_node=1, timeout_s=20)
    took = time.monotonic() - started
    message = str(caught.value)
    assert "the 2 agents did not finish within 20 s and were stopped" in message, message
    assert "--- agent 0" in message and "--- agent 1" in message, message
    assert "waits forever" in message, message  # the workers' output reaches the tails
    assert took < 20 + 15, took  # stopped at the limit (+ the kill grace), not left running
    assert all(session_processes(sid) == [] for sid in caught.value.sessions), "an agent or worker survived"
