"""The tensor-parallel ranks' shared-memory gathers: every rank gets every part in rank order, for
any shape (larger than a slot too); a missing rank times out, an abort ends a wait at once, and the
file is private to the user and gone once unlinked. Ranks run as threads here, each with its own
mapping of the file, as the processes of a replica have."""

from __future__ import annotations

import os
import stat
import threading

import pytest
import torch

from shoal.parallel.shared_memory_group import SharedMemoryGroup

SLOT = 4096


def ranks(size: int, timeout_s: float = 30.0) -> list[SharedMemoryGroup]:
    first = SharedMemoryGroup.create(size, SLOT, timeout_s)
    return [first] + [SharedMemoryGroup(first.path, r, size, SLOT, timeout_s) for r in range(1, size)]


def run_ranks(groups: list[SharedMemoryGroup], body) -> list:
    results, errors = [None] * len(groups), []

    def run(group: SharedMemoryGroup) -> None:
        try:
            results[group.rank] = body(group)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


def tensors_of(rank: int) -> list[torch.Tensor]:
    """What rank `rank` gathers, in order: small, bigger than a slot (row chunks), empty, 16-bit."""
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(100, 33, generator=g),  # 13 KB: four chunks of 31 rows, a generation each
        torch.zeros(0, 8),
        torch.randn(7, 64, generator=g).bfloat16(),
    ]


def test_every_rank_gets_every_part_in_rank_order():
    groups = ranks(3)
    try:
        gathered = run_ranks(groups, lambda group: [group.all_gather(t) for t in tensors_of(group.rank)])
        for per_rank in gathered:
            for index, parts in enumerate(per_rank):
                expected = [tensors_of(r)[index] for r in range(3)]
                assert all(torch.equal(p, e) and p.dtype == e.dtype for p, e in zip(parts, expected))
        assert len({g.generation for g in groups}) == 1
    finally:
        groups[0].unlink()


def test_a_rank_that_never_comes_times_out():
    groups = ranks(2, timeout_s=0.3)
    try:
        with pytest.raises(RuntimeError, match="did not reach gather 1"):
            groups[0].all_gather(torch.ones(2, 2))
    finally:
        groups[0].unlink()


def test_abort_ends_a_wait_at_once():
    groups = ranks(2)
    try:
        timer = threading.Timer(0.2, groups[0].abort, args=("rank 1 exited",))
        timer.start()
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            groups[0].all_gather(torch.ones(2, 2))
    finally:
        groups[0].unlink()


def test_the_file_is_the_users_alone_and_gone_once_unlinked():
    groups = ranks(2)
    mode = stat.S_IMODE(os.stat(groups[0].path).st_mode)
    assert mode == 0o600, oct(mode)
    assert not groups[1].joined() and not groups[0].joined()
    groups[1].join()
    assert groups[0].joined()
    groups[0].unlink()
    assert not os.path.exists(groups[0].path)
    # The ranks' mappings outlive the name.
    out = run_ranks(groups, lambda group: group.all_gather(torch.full((1, 1), float(group.rank))))
    assert [p.item() for p in out[0]] == [0.0, 1.0]
