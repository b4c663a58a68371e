"""trace_lightning/collectives.py: failing together. The collective itself (``any_failed``)
is simulated here; the two-process runs with the real one are in test_rollout.py
(a retriever down on one rank), test_fit.py (prepare_data) and test_export.py."""

from __future__ import annotations

import pytest

from trace_lightning.collectives import RankFailed, fail_together, raise_together


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
