"""Stage contracts (pipeline/plan/stages.py): each staging stage needs and adds the columns it declares.

Runs the stages on the sample corpus (no engine: staging is CPU only) and checks every declaration
against the tables that actually flow, including that a stage fed only its declared `needs` still
works (so it reads no column it does not declare).
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.plan.stages import (
    STAGED_COLUMNS,
    STAGES,
    Stage,
    StageContext,
    StageContractError,
    run_stages,
    stage_named,
    staged_input,
)


@pytest.fixture
def config(make_config, sample_corpus):
    root, _ = sample_corpus
    return make_config(root, routing=True)  # the local config's route rules and semantic reuse on


@pytest.fixture
def cache(config):
    from pipeline.stores.cache import open_store

    return open_store(config.cache)


def test_each_stage_needs_and_adds_what_it_declares(config, cache):
    ctx = StageContext(config, "stages", config.input.uri, cache)
    table = pa.table({})
    for stage in STAGES:
        missing = set(stage.needs) - set(table.column_names)
        assert not missing, f"{stage.name}: declared needs {sorted(missing)} not produced by the stages before it"
        out = stage.fn(table, ctx)
        added = set(out.column_names) - set(table.column_names)
        removed = set(table.column_names) - set(out.column_names)
        assert added == set(stage.adds), f"{stage.name}: added {sorted(added)}, declares {sorted(stage.adds)}"
        assert removed == set(stage.drops), f"{stage.name}: removed {sorted(removed)}, declares {sorted(stage.drops)}"
        assert len(set(out.column_names)) == out.num_columns, f"{stage.name}: a column twice"
        if stage.name not in ("read", "validate"):
            assert out.num_rows == table.num_rows, f"{stage.name}: changed the number of records"

        # Fed only what it declares it needs, the stage still runs and adds the same columns (a stage that
        # reads texts gets them from the context, as a shard does).
        texts = table["text"].to_pylist().__getitem__ if stage.reads_text else None
        alone_ctx = StageContext(config, "stages", config.input.uri, cache, texts=texts)
        alone = stage.fn(table.select(list(stage.needs)), alone_ctx)
        assert set(alone.column_names) == (set(stage.needs) - set(stage.drops)) | set(stage.adds), stage.name
        table = out
    assert tuple(table.column_names) == STAGED_COLUMNS
    assert table.num_rows > 0
    assert ctx.raw.num_rows == table.num_rows + ctx.quarantine.num_rows  # every record leaves validate once
    assert set(table["tier"].to_pylist()) == {"small", "large"}  # the route rules ran
    assert ctx.dedup is not None and ctx.dedup.clusters  # the corpus has near duplicates


def test_staged_input_checks_the_contracts_and_returns_every_side_output(config, cache):
    staged = staged_input(config, "stages", cache=cache)
    assert tuple(staged.records.column_names) == STAGED_COLUMNS
    assert staged.raw.num_rows == staged.records.num_rows + staged.quarantine.num_rows
    assert staged.quarantine.num_rows > 0  # the sample corpus has bad records
    assert staged.dedup.as_dict()["reused"]


def _add(name: str):
    return lambda table, ctx: table.append_column(name, pa.array([1] * table.num_rows))


@pytest.mark.parametrize(
    "stage, message",
    [
        (
            Stage("needy", needs=("id", "tier"), adds=(), fn=lambda t, c: t),
            "stage 'needy' needs columns ['tier'] missing from its input (input has ['id', 'text'])",
        ),
        (
            Stage("lazy", needs=("id",), adds=("tier",), fn=lambda t, c: t),
            "stage 'lazy' broke its contract: did not add declared columns ['tier']",
        ),
        (
            Stage("sneaky", needs=("id",), adds=("tier",), fn=lambda t, c: _add("extra")(_add("tier")(t, c), c)),
            "stage 'sneaky' broke its contract: added undeclared columns ['extra']",
        ),
        (
            Stage("doubler", needs=("id",), adds=(), fn=_add("text")),
            "stage 'doubler' broke its contract: returned columns ['text'] twice",
        ),
        (
            Stage("eraser", needs=("id",), adds=(), fn=lambda t, c: t.drop_columns(["text"])),
            "stage 'eraser' broke its contract: removed ['text'], declared drops []",
        ),
    ],
)
def test_a_stage_that_breaks_its_contract_is_named(stage, message):
    table = pa.table({"id": ["a", "b"], "text": ["x", "y"]})
    ok = Stage("first", needs=("id",), adds=(), fn=lambda t, c: t)
    with pytest.raises(StageContractError) as e:
        run_stages((ok, stage), table, context=None)
    assert str(e.value) == message


def test_the_streamed_steps_run_every_declared_stage_once_in_order():
    """Planning's steps (reader, keyed, per shard, per partition) run the entries of STAGES, no other function."""
    from pipeline.plan.streamed import KEYED_STAGES

    steps = [stage_named("read"), *KEYED_STAGES, stage_named("cluster"), stage_named("gen_text")]
    assert tuple(steps) == STAGES


def test_a_stage_that_reads_texts_needs_a_text_column_or_a_source(config):
    cluster = stage_named("cluster")
    table = pa.table({c: pa.array([], pa.string()) for c in cluster.needs})
    with pytest.raises(StageContractError, match=r"needs columns \['text'\]"):
        run_stages((cluster,), table, StageContext(config, "stages", config.input.uri))
