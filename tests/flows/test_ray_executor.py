"""Dedup across two Ray workers (flows.ray_executor.RayExecutor) gives the single-process clusters."""

from __future__ import annotations

import polars as pl
import pytest

from tasks.curation.recipes import Recipe, step
from tasks.curation.sharded import curate_corpus
from tests.tasks.curation.test_sharded import write_near_duplicate_corpus

DEDUP = Recipe(steps=(step("exact_dedup"), step("minhash", threshold=0.8, bands=28, rows=4)))


@pytest.mark.ray  # starts a 2-CPU local cluster: about 13 s on 2 busy cores
def test_dedup_on_two_ray_workers_equals_the_single_process_run(tmp_path):
    pytest.importorskip("ray")
    import ray

    from flows.ray_executor import RayExecutor

    if ray.is_initialized():
        pytest.skip("a Ray runtime is already up in this process; this test starts its own")
    inputs = write_near_duplicate_corpus(tmp_path)
    serial = curate_corpus(inputs, tmp_path / "serial", DEDUP, shard_docs=8, n_workers=1)
    with RayExecutor(num_cpus=2) as executor:
        assert ray.cluster_resources()["CPU"] == 2
        on_ray = curate_corpus(inputs, tmp_path / "ray", DEDUP, shard_docs=8, executor=executor)
    assert not ray.is_initialized()  # the executor stopped the cluster it started

    def clusters(out):
        dropped = pl.read_parquet(out / "dropped.parquet")
        return (pl.read_parquet(out / "kept.parquet")["id"].to_list(),
                sorted(dropped.select("id", "reason", "duplicate_of").iter_rows()))

    kept, dropped = clusters(tmp_path / "ray")
    assert (kept, dropped) == clusters(tmp_path / "serial")
    reasons = {r for _id, r, _of in dropped}
    assert reasons == {"exact_dedup.duplicate", "minhash.near_duplicate"}
    assert sum(r == "minhash.near_duplicate" for _id, r, _of in dropped) >= 10
    assert on_ray["run"]["shards_computed"] == serial["run"]["shards_computed"] >= 2
    assert -(-serial["docs_in"] // 8) >= 8  # the copies sit in other shards than their originals
    for key in ("docs_kept", "dropped_by_reason", "steps"):
        assert on_ray[key] == serial[key], key
