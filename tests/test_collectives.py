"""trace_lightning/collectives.py: failing together, and the gloo group the control-plane
collectives run on. The collective itself (``any_failed``)
is simulated here; the two-process runs with the real one are in test_rollout.py
(a retriever down on one rank), test_fit.py (prepare_data) and test_export.py."""

from __future__ import annotations

import pytest

from trace_lightning.collectives import RankFailed, fail_together, raise_together
from launch import leave_group


class Peers:
    """``any_failed`` of a process whose peers failed or not; records what it was told."""

    def __init__(self, peer_failed: bool):
        self.peer_failed, self.told = peer_failed, []

    def __call__(self, failed: bool) -> bool:
        self.told.append(failed)
        return failed or self.peer_failed


def test_the_process_that_failed_raises_its_own_error_after_telling_the_others():
    peers = Peers(peer_failed=False)
    with pytest.raises(FileNotFoundError, match="corpus.jsonl"):
        with fail_together("setting up", peers):
            raise FileNotFoundError("corpus.jsonl")
    assert peers.told == [True]


def test_a_process_whose_peer_failed_raises_rank_failed_naming_the_work():
    peers = Peers(peer_failed=True)
    with pytest.raises(RankFailed, match="another process failed setting up; its log has"):
        with fail_together("setting up", peers):
            pass
    assert peers.told == [False]


def test_nobody_failed_nothing_raised_and_the_collective_still_runs():
    peers = Peers(peer_failed=False)
    with fail_together("setting up", peers):
        done = True
    assert done and peers.told == [False]
    raise_together(None, peers, "x")
    assert peers.told == [False, False]


def test_one_process_raises_as_it_would_without():
    with pytest.raises(KeyError):
        with fail_together("setting up", None):
            raise KeyError("k")
    raise_together(None, None, "x")  # nothing failed, no collective to call
    with pytest.raises(ValueError, match="bad"):
        raise_together(ValueError("bad"), None, "x")


def _cpu_group_worker(rank: int, world: int, out_dir: str) -> None:
    """Two gloo processes whose default group says it is NCCL (what Lightning's CUDA
    strategies give; NCCL itself cannot run here): the flags and objects travel over a gloo
    group of their own, and rank 1 never touches a device."""
    import datetime
    import json
    from unittest import mock

    import torch.distributed as dist

    from trace_lightning import collectives as c

    trainer = type("Trainer", (), {"world_size": world})()
    out, groups = {}, []
    for round_ in range(2):  # a second default group (a second fit) gets its own gloo group
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous{round_}",
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        world_group = dist.group.WORLD
        real_backend = dist.get_backend
        with mock.patch.object(dist, "get_backend", side_effect=lambda g=None: (
                "nccl" if g in (None, world_group) else real_backend(g))):
            flags = c.any_rank([rank == 1, False])
            group = c.cpu_group()
            out[round_] = {
                "flags": flags,
                "own_group": group is not world_group,
                "gloo": real_backend(group) == "gloo",
                "cached": c.cpu_group() is group,
                "gathered": c.all_gather_list([f"r{rank}"], trainer),
                "from_rank0": c.from_rank0(f"r{rank}"),
            }
            groups.append(group)
        leave_group()
    out["new_group_per_world"] = groups[0] is not groups[1]
    # a gloo default group (the CPU strategies') is used as it is
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous2", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    out["gloo_default"] = c.cpu_group() is dist.group.WORLD and c.any_rank([rank == 0]) == [True]
    leave_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)


def test_flags_and_objects_travel_over_a_gloo_group_whatever_the_trainers_backend(tmp_path):
    """Under NCCL the control-plane collectives (failure flags, gathered objects) ran on the
    GPU: a process with a broken CUDA context (a sticky CUDA error) could not even send its
    failure, and the others waited in the all-reduce until the group's timeout. They now run
    over a gloo group: created once per default group, the default group itself when it is
    gloo. The NCCL backend is simulated (its name only): it cannot run without a GPU. (In
    processes of their own: destroying a default group in pytest's would destroy the groups
    of vLLM's in-process engines too.)"""
    import json

    import torch

    torch.multiprocessing.spawn(_cpu_group_worker, args=(2, str(tmp_path)), nprocs=2)
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["new_group_per_world"] and out["gloo_default"]
        for round_ in ("0", "1"):
            assert out[round_] == {"flags": [True, False], "own_group": True, "gloo": True,
                                   "cached": True, "gathered": ["r0", "r1"],
                                   "from_rank0": "r0"}, (rank, out)
