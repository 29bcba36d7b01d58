"""Streamed, sharded planning (pipeline/plan/streamed.py): the staged partitions are the same as the
in-memory stages give, for any number of planning processes, and nothing is lost on the way.

No engine: planning is CPU only. The sample corpus has three tenants (three dedup scopes), near
duplicates, semantic neighbours, bad records and an id repeated across files.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipeline.dedup.split import shards_of
from pipeline.keys import config_fingerprint
from pipeline.plan.stages import STAGED_COLUMNS, staged_input
from pipeline.plan.streamed import plan_job
from pipeline.stores import storage
from pipeline.stores.catalog import migrate
from pipeline.stores.staging import StagingArea


@pytest.fixture
def config(make_config, sample_corpus):
    root, _ = sample_corpus
    # A second file repeating an id of the first (the first valid occurrence wins, across files), a
    # near copy in another file, and a file with only bad records.
    first = json.loads((root / "batch-a.jsonl").read_text().splitlines()[0])
    with open(root / "zz-late.jsonl", "w") as f:
        f.write(json.dumps({"id": first["id"], "text": "another text under a taken id", "tenant": "acme"}) + "\n")
        f.write(
            json.dumps({"id": "late-near", "text": first["text"] + " Thanks.", "tenant": first.get("tenant")}) + "\n"
        )
    (root / "zz-bad.jsonl").write_text("{not json\n\n")
    config = make_config(root, routing=True, input__records_per_partition=7)
    migrate(config.state.url)  # as the DAG's first task or `run_job` does: these tests call the steps alone
    return config


def staged(config, workers: int, tmp_path, name: str) -> tuple[pa.Table, pa.Table, object]:
    area = StagingArea(storage.resolve(str(tmp_path / name)), "plan")
    plan = plan_job(config, "plan", area, workers=workers)
    records = pa.concat_tables([area.records(p) for p in plan.partitions])
    quarantine = pa.concat_tables([area.quarantine(p) for p in plan.partitions])
    return records, quarantine, plan


def ordered(table: pa.Table) -> pa.Table:
    return table.sort_by(
        [("partition", "ascending"), ("id", "ascending"), ("file", "ascending"), ("line", "ascending")]
    )


def test_planned_partitions_equal_the_in_memory_stages_for_any_number_of_workers(config, tmp_path):
    whole = staged_input(config, "plan")
    one, q1, plan1 = staged(config, 1, tmp_path, "one")
    three, q3, plan3 = staged(config, 3, tmp_path, "three")
    assert plan1.shards == 1 and plan3.shards == 3  # three tenants, three shards
    assert tuple(one.column_names) == STAGED_COLUMNS
    # Every record read ends in exactly one place.
    assert plan1.records == whole.raw.num_rows == one.num_rows + q1.num_rows
    assert plan1.quarantined == q1.num_rows == whole.quarantine.num_rows
    assert "duplicate_id" in q1["reason"].to_pylist()
    # The streamed plan is the in-memory one; the sharded plan is the unsharded one (no cross-shard misses:
    # shards hold whole scopes, and scopes never share an output).
    expected = ordered(whole.records.select(list(STAGED_COLUMNS)))
    assert not differences(ordered(one), expected)
    assert not differences(ordered(three), ordered(one))
    assert not differences(ordered(q3), ordered(q1))
    assert set(pc.unique(one["reuse"]).to_pylist()) >= {None, "near_duplicate"}
    assert plan3.dedup.as_dict()["reused"] == plan1.dedup.as_dict()["reused"] == whole.dedup.as_dict()["reused"]
    # The near copy in the late file reuses its original's output, whose text it carries along.
    late = one.filter(pc.equal(one["id"], "late-near")).to_pylist()[0]
    assert late["reuse"] == "near_duplicate" and late["gen_text"]


def test_shards_hold_whole_scopes_balanced_by_rows():
    shards = shards_of({("a", 0): 100, ("b", 0): 60, ("c", 0): 50, ("d", 0): 10}, 2)
    assert shards == [[("a", 0), ("d", 0)], [("b", 0), ("c", 0)]]
    assert shards_of({("a", 0): 5}, 4) == [[("a", 0)]]  # never an empty shard
    assert shards_of({}, 4) == []
    # The parts of a cut scope are shard scopes like any other.
    assert shards_of({("a", 0): 50, ("a", 1): 50, ("b", 0): 10}, 2) == [[("a", 0), ("b", 0)], [("a", 1)]]


def differences(a: pa.Table, b: pa.Table) -> list[str]:
    """Columns whose values differ, with the first differing row: a readable failure."""
    if a.num_rows != b.num_rows:
        return [f"{a.num_rows} rows vs {b.num_rows}"]
    out = []
    for name in a.column_names:
        x, y = a[name].to_pylist(), b[name].to_pylist()
        if x != y:
            i = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
            out.append(f"{name} row {i} ({a['id'][i]}): {str(x[i])[:80]!r} vs {str(y[i])[:80]!r}")
    return out


def test_planning_as_orchestrator_tasks_stages_what_one_process_stages(config, tmp_path):
    """The DAG's steps (plan, cluster per shard in any order, stage) give the partitions plan_job gives;
    run again once staged, each returns at once."""
    from pipeline.job import orchestrate
    from pipeline.job.context import JobContext

    config.planning.workers = 2
    shards = orchestrate.keyed_shards(config, "tasks")
    assert len(shards) == 2
    reused: dict[str, int] = {}
    for shard in reversed(shards):
        for kind, n in orchestrate.clustered_shard(config, "tasks", shard)["reused"].items():
            reused[kind] = reused.get(kind, 0) + n
    partitions = orchestrate.planned_partitions(config, "tasks")
    one, q1, plan1 = staged(config, 1, tmp_path, "one")
    assert sorted(partitions) == sorted(plan1.partitions)
    assert reused == plan1.dedup.as_dict()["reused"] and reused
    area = JobContext.open(config, "tasks").staging
    tasks = pa.concat_tables([area.records(p) for p in partitions])
    assert not differences(ordered(tasks), ordered(one))
    assert orchestrate.keyed_shards(config, "tasks") == [] and orchestrate.clustered_shard(config, "tasks", 0) == {}
    assert orchestrate.planned_partitions(config, "tasks") == partitions


def test_input_without_a_valid_record_is_all_quarantine(make_config, tmp_path):
    """Reproducer: no valid record meant no shard, and staging failed on an empty list of decisions."""
    root = tmp_path / "bad"
    root.mkdir()
    (root / "only-bad.jsonl").write_text('{not json\n{"id": "a", "text": "  "}\n{"text": "no id"}\n')
    config = make_config(root)
    records, quarantine, plan = staged(config, 1, tmp_path, "bad-out")
    assert records.num_rows == 0 and quarantine.num_rows == plan.records == 3
    assert sorted(quarantine["reason"].to_pylist()) == ["empty_text", "malformed_json", "missing_id"]


def test_stage_refuses_shards_of_an_earlier_planning(config, tmp_path):
    """Reproducer: the input keyed again (as a reclaimed staging does) and its shards not clustered again:
    the shards' decisions belong to the earlier planning (its input may have changed since), and are not
    applied."""
    from pipeline.errors import JobError
    from pipeline.plan.streamed import list_input, plan_keyed, plan_shard, plan_staged

    area = StagingArea(storage.resolve(str(tmp_path / "stale")), "stale")
    first = plan_keyed(config, "stale", area, list_input(config), workers=2)
    for shard in range(first.shards):
        plan_shard(config, "stale", area, shard)
    plan_keyed(config, "stale", area, list_input(config), workers=2)  # planned again; its shards are not clustered
    with pytest.raises(JobError, match="not clustered for its latest planning"):
        plan_staged(config, "stale", area)


def test_stage_waits_for_a_planning_in_progress_instead_of_failing_it(config):
    """Reproducer: `stage` called while another worker plans the job whole (status staging, no
    plan.json yet) raised on the missing plan and marked that worker's live staging failed, so a third
    worker could take it over at once and two plannings wrote one staging area. It waits instead; and a
    step failing after the job is staged never marks it failed."""
    import threading

    from pipeline.job import orchestrate
    from pipeline.job.context import JobContext
    from pipeline.job.plan import plan_input, planning_step

    job = JobContext.open(config, "busy")
    assert job.state.claim_planning("busy", config_fingerprint(config), config.input.uri, config.output.uri)  # planning
    staged = []
    stage = threading.Thread(target=lambda: staged.append(orchestrate.planned_partitions(config, "busy")))
    stage.start()
    stage.join(timeout=2 * config.state.wait_seconds + 1)
    assert stage.is_alive() and job.state.job("busy").status == "planning"  # waiting, the staging untouched
    assert not job.state.reclaim_planning("busy", config.state.lease_seconds)
    plan_input(job.planning(), 1)  # the planning worker finishes (its claim: epoch 1)
    stage.join(timeout=60)
    assert not stage.is_alive() and staged and staged[0] == [p.partition for p in job.state.partitions("busy")]
    with pytest.raises(RuntimeError), planning_step(job.planning(), 1):
        raise RuntimeError("a late step of an earlier attempt fails")
    assert job.state.job("busy").status == "planned"


def test_staged_partitions_stages_whole_when_no_planning_task_ran(config):
    """Reproducer: `stage` (the old single staging entry point) called with no `plan` task before it."""
    from pipeline.job import orchestrate

    partitions = orchestrate.planned_partitions(config, "whole")
    assert partitions and orchestrate.clustered_shard(config, "whole", 0) == {}


def test_a_staging_step_renews_its_lease_while_it_runs(config):
    """Planning a large job outlasts state.lease_seconds: while a step runs, no other worker may take the
    staging over; once it stops renewing (its worker died), one may."""
    import time

    from pipeline.job.context import JobContext
    from pipeline.job.plan import planning_step
    from pipeline.stores.catalog import aware

    def wait_until(condition):  # on the database's clock; the limit only guards against a hang
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    lease = config.state.lease_seconds = 3.0
    job = JobContext.open(config, "lease")
    epoch = job.state.claim_planning(
        "lease", config_fingerprint(config), config.input.uri, config.output.uri, lease_seconds=lease
    )
    claimed = aware(job.state.job("lease").planning_renewed_at)
    with planning_step(job.planning(), epoch):  # renews every lease / 3
        # Past the claim's own lease end, with a renewal since: the step's beats keep it.
        wait_until(
            lambda: (
                (job.state.db_now() - claimed).total_seconds() > lease
                and (aware(job.state.job("lease").planning_renewed_at) - claimed).total_seconds() > lease / 2
            )
        )
        assert not job.state.reclaim_planning("lease", lease)
    renewed = aware(job.state.job("lease").planning_renewed_at)  # the step ended: no beat moves it again
    wait_until(lambda: (job.state.db_now() - renewed).total_seconds() > lease)
    assert job.state.reclaim_planning("lease", lease)


def test_a_shard_task_that_failed_once_is_retried_and_the_job_is_staged(config, monkeypatch):
    """Reproducer: a failed shard task marks the staging failed; Airflow retries it, and the stage task must
    then take the staging over and register it, not refuse it as "taken over" forever."""
    from pipeline.job import orchestrate
    from pipeline.job import plan as plan_step
    from pipeline.stores.catalog import StateStore

    config.planning.workers = 2
    shards = orchestrate.keyed_shards(config, "retried")
    assert len(shards) == 2
    real, calls = plan_step.plan_shard, []

    def lost_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise OSError("shard worker lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_step, "plan_shard", lost_once)
    with pytest.raises(OSError):
        orchestrate.clustered_shard(config, "retried", shards[0])
    state = StateStore(config.state.url)
    assert state.job("retried").status == "planning_failed"
    for shard in shards:  # the retry, and the other shard's task
        orchestrate.clustered_shard(config, "retried", shard)
    partitions = orchestrate.planned_partitions(config, "retried")
    assert partitions and state.job("retried").status == "planned"
    assert orchestrate.planned_partitions(config, "retried") == partitions  # and again: the same, at once


def test_a_job_of_many_small_files_says_how_planning_goes(make_config, tmp_path, caplog):
    """Reproducer: planning printed nothing until its last file was keyed, so a job of
    20,000 one-record files looked stuck. Now every planning step says how far it is, before any item exists."""
    import re

    from pipeline import run_job
    from pipeline.job.progress import Progress

    files = 30
    folder = tmp_path / "input"
    folder.mkdir()
    for i in range(files):
        (folder / f"doc-{i:03d}.jsonl").write_text(
            json.dumps({"id": f"d{i}", "text": f"Document {i} about topic {i}."}) + "\n"
        )
    progress = Progress("log", log_every_seconds=0)  # every step's every input: a line
    with caplog.at_level("INFO", logger="tokenmill.progress"):
        run_job(make_config(folder), job_id="many", progress=progress)
    planning = [r.getMessage() for r in caplog.records if r.getMessage().startswith("planning: ")]
    keyed = [
        int(m.group(1))
        for line in planning
        if (m := re.match(r"planning: keyed (\d+)/30 input files or packs; ", line))
    ]
    assert keyed == list(range(1, files + 1))
    assert any(re.match(r"planning: clustered (\d+)/\1 shards; \d+ s elapsed", line) for line in planning)
    assert any(re.match(rf"planning: staged {files}/{files} partitions; \d+ s elapsed", line) for line in planning)
    first_item_line = next(i for i, r in enumerate(caplog.records) if r.getMessage().startswith("progress: "))
    assert all(
        caplog.records.index(r) < first_item_line for r in caplog.records if r.getMessage().startswith("planning: ")
    )


def test_a_folder_of_one_document_files_is_packed_into_few_partitions(make_config, tmp_path):
    """20,000 one-document .txt files were 20,000 partitions (staged files, work units, a
    commit and an Airflow task each). They are packed into partitions of records_per_partition files; ids,
    files and texts stay each file's own, streamed planning equals the in-memory stages, every record once."""
    from pipeline import run_job
    from pipeline.ingest.read import partition_id
    from tests.jobs import assert_exactly_once

    folder = tmp_path / "input"
    (folder / "docs").mkdir(parents=True)
    names = [f"docs/{i:04d}.txt" for i in range(600)]
    for i, name in enumerate(names):
        (folder / name).write_text(f"Report {i % 200}: the plant in district {i % 200} shipped {i % 200} units.")
    (folder / "docs" / "0100.txt").write_bytes(b"\xff\xfe not utf-8")  # a bad file in a pack: quarantined alone
    config = make_config(folder, input__records_per_partition=250)

    whole = staged_input(config, "pack")
    one, q1, plan1 = staged(config, 1, tmp_path, "one")
    two, q2, _ = staged(config, 2, tmp_path, "two")
    assert len(plan1.partitions) == 3 and partition_id(names[0], 0) not in plan1.partitions  # 250 + 250 + 100
    assert sorted(v["records"] for v in plan1.partitions.values()) == [100, 250, 250]
    assert not differences(ordered(one), ordered(whole.records.select(list(STAGED_COLUMNS))))
    assert not differences(ordered(two), ordered(one)) and not differences(ordered(q2), ordered(q1))
    assert one.num_rows == 599 and q1["reason"].to_pylist() == ["invalid_utf8"]
    assert set(one["id"].to_pylist()) == set(one["file"].to_pylist()) == set(names) - {"docs/0100.txt"}
    assert len(set(one["gen_key"].to_pylist())) == 200  # 200 texts three times: across packs, one generation each

    result = run_job(config, job_id="packed")
    assert result.manifest.as_json()["status"] == "succeeded" and len(result.manifest.as_json()["partitions"]) == 3
    ids = [n for n in names if n != "docs/0100.txt"]
    assert_exactly_once(config.output.uri, "packed", {"ids": ids, "bad_records": 1}, tmp_path / "state.db")
