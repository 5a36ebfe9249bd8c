"""The replica study (`tools/lab/replica_study.py`) end to end, small: modelled replicas behind the real router
serve the multi-tenant workload, every request completes, and the table reads the replicas' own hit counters."""

import shutil

import pytest

from deltaserve.tools.lab import replica_study


@pytest.mark.skipif(shutil.which("vllm-router") is None, reason="vllm-router is not installed")
def test_two_modelled_replicas_behind_the_router_keep_their_tenants_prefixes():
    ns = replica_study.options([
        "--replicas", "2", "--policies", "cache_aware", "--conversations", "8", "--concurrency", "2", "--turns", "2",
        "--tenants", "2", "--tenant-prompt-len", "64", "--question-len", "8", "--output-len", "4",
        "--device", "--step-ms 2 --max-model-len 512"])
    single, rows = replica_study.study(ns)
    assert single["failed"] == 0 and [r["n"] for r in rows] == [2] and rows[0]["failed"] == 0
    # 16 conversations over 2 tenants: all but a tenant's first two (one of them branches off the other) resume
    # its 64-token prompt, and every second turn its first; the replicas' counters see it
    assert rows[0]["hit_rate"] > 0.4 and single["hit_rate"] > 0.4
    assert rows[0]["per_replica"] > 0 and "| 2 | cache_aware |" in replica_study.table(single, rows, "vllm")
