"""Helpers for tests that start processes: a free local port, ranks started side by side
as torchrun or srun would (Lightning sees LOCAL_RANK and joins them instead of launching), and
the end of a spawned rank's process group."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: Path, args: list[str], cwd: Path, world: int = 2,
              timeout: float = 300) -> list[tuple[int | None, str]]:
    """Run ``python script *args`` as ranks 0..world-1 of one gloo job -> (exit status, output)
    per rank. A rank still running after ``timeout`` seconds is killed; its status is None."""
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                NODE_RANK="0")
    procs = [subprocess.Popen([sys.executable, str(script), *args], cwd=cwd,
                              env=dict(base, LOCAL_RANK=str(r), RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    results = []
    try:
        for p in procs:
            try:
                out = p.communicate(timeout=timeout)[0]
                results.append((p.returncode, out))
            except subprocess.TimeoutExpired:
                p.kill()
                results.append((None, p.communicate()[0]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


def leave_group() -> None:
    """End a spawned rank's process group together with the other ranks: they meet at a
    barrier first, because a gloo group destroyed on one rank while another still talks to it
    can abort that rank at teardown ("terminate called without an active exception")."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
