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
    row = replica_study.one_run(ns, 2, "vllm", "cache_aware", ns.concurrency)
    assert row["n"] == 2 and row["failed"] == 0 and row["tok_s"] > 0 and row["spread"] >= 1.0
    # 16 conversations over 2 tenants: all but a tenant's first two (one of them branches off the other) resume
    # its 64-token prompt, and every second turn its first; the replicas' counters see it
    assert row["hit_rate"] > 0.4
    row.update(per_replica=1.0, hits_vs_one=1.0)
    assert "| 2 | cache_aware | 1.000 |" in replica_study.table(dict(row, n=1), [row], "vllm")
