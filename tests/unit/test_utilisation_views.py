"""Engine utilisation where people look, from synthetic manifests, ledgers and catalogs
(no engine): the report's waterfall adds start-up, idle and escalation as costs, its utilisation table and
whole partition labels; the `tokenmill run` summary's tier lines; `tokenmill status`'s tier workers and
work-unit depth."""

import json
import re
from datetime import datetime, timezone

import duckdb
import pyarrow as pa
import pytest
from rich.console import Console
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.cli.jobs import summary_table
from pipeline.output.charts import CHAR_W
from pipeline.output.manifest import Manifest
from pipeline.output.report import build_report, savings_steps
from pipeline.output.tables import commit_rows
from pipeline.schema import LEDGER, OUTPUTS, QUARANTINE
from pipeline.stores import storage
from pipeline.stores.catalog import StateStore, migrate
from pipeline.stores.units import UnitQueue
from tests.conftest import TINY_CONFIG

SMALL, LARGE = 0.5, 2.0  # $ per GPU-hour
LONG_PARTITION = "0123456789-00042-a-partition-name-long-enough-to-overflow-the-old-170px-label-column"
LONG_FILE = "tenants/acme/2026/11/30/exports/nightly/very-long-directory-name/documents-part-0007.jsonl"


def usd(gpu_seconds: float, price: float) -> float:
    return gpu_seconds * price / 3600.0


def row(
    partition: str,
    id_: str,
    tier: str,
    source: str | None,
    busy: float,
    overhead: float,
    price: float,
    baseline: float,
    kind: str = "output",
    escalated: bool = False,
    cost: float | None = None,
) -> dict:
    return {
        "job_id": "u",
        "partition": partition,
        "id": id_,
        "tenant": "acme",
        "tier": tier,
        "model": f"m-{tier}",
        "source": source,
        "kind": kind,
        "escalated": escalated,
        "escalation_reason": "low_logprob" if escalated else None,
        "prompt_tokens": 100,
        "cached_prompt_tokens": 0,
        "output_tokens": 20,
        "gpu_seconds": busy + overhead,
        "busy_gpu_seconds": busy,
        "overhead_gpu_seconds": overhead,
        "price_per_gpu_hour": price,
        "cost_usd": usd(busy + overhead, price) if cost is None else cost,
        "baseline_cost_usd": baseline,
        "saved_cost_usd": 0.0,
        "quarantined": False,
        "created_at": datetime(2026, 11, 30, tzinfo=timezone.utc),
    }


def ledger_rows(partition: str = "p0") -> list[dict]:
    """Kept on small; kept on large; escalated small -> large; a failed attempt; an in-job duplicate.

    The escalated row: first attempt 8 busy + 1.6 overhead GPU-s on small, final 6 + 1.2 on large, at the
    blended price that keeps cost = GPU-seconds × price; its baseline (15.6 GPU-s on large) is below what
    it paid, so the old waterfall's "prefix cache and batching" came out negative."""
    esc_cost = usd(9.6, SMALL) + usd(7.2, LARGE)
    return [
        row(partition, "a", "small", "generated", 10, 2, SMALL, usd(9, LARGE)),
        row(partition, "b", "large", "generated", 5, 1, LARGE, usd(7, LARGE)),
        row(
            partition,
            "c",
            "large",
            "generated",
            14,
            2.8,
            esc_cost * 3600 / 16.8,
            usd(7.8, LARGE),
            escalated=True,
            cost=esc_cost,
        ),
        row(partition, "d", "small", None, 3, 0.6, SMALL, 0.0, kind="failed_attempt"),
        row(partition, "e", "small", "duplicate_in_job", 0, 0, SMALL, usd(5, LARGE), cost=0.0),
    ]


def ledger_con(rows: list[dict]) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.register("ledger", pa.Table.from_pylist(rows, schema=LEDGER))
    return con


def test_waterfall_adds_start_up_idle_and_escalation_and_saves_no_negative_prefix():
    rows = ledger_rows()
    steps, notes = savings_steps(ledger_con(rows), "u", "large")
    by = dict(steps)
    assert by["reuse: duplicate in job"] == pytest.approx(-usd(5, LARGE))
    assert by["routing to smaller tiers"] == pytest.approx(-(usd(9, LARGE) - usd(10, SMALL)))
    # Kept on large: 7 - 5 GPU-s; the escalation's final attempt on large: 7.8 - 6. Both savings, never negative.
    assert by["prefix cache and batching"] == pytest.approx(-(usd(2, LARGE) + usd(1.8, LARGE)))
    overhead = usd(2, SMALL) + usd(1, LARGE) + usd(1.6, SMALL) + usd(1.2, LARGE) + usd(0.6, SMALL)
    assert by["engine start-up and idle"] == pytest.approx(overhead) and overhead > 0
    assert by["escalation: attempts before it"] == pytest.approx(usd(8, SMALL))  # the first attempt's busy share
    assert by["failed attempts and lost work"] == pytest.approx(usd(3, SMALL))
    baseline, paid = sum(r["baseline_cost_usd"] for r in rows), sum(r["cost_usd"] for r in rows)
    assert baseline + sum(by.values()) == pytest.approx(paid)  # the steps add up to what was paid
    assert "derived from each row's blended price" in " ".join(notes)

    # The old computation (baseline - cost of generated rows on the largest tier) was negative here.
    old = sum(
        r["baseline_cost_usd"] - r["cost_usd"] for r in rows if r["source"] == "generated" and r["tier"] == "large"
    )
    assert old < 0


def test_waterfall_escalation_falls_back_to_above_baseline_when_prices_cannot_split_it():
    rows = [r for r in ledger_rows() if r["tier"] == "large"]  # no small-tier row: its price is unknown
    steps, notes = savings_steps(ledger_con(rows), "u", "large")
    by = dict(steps)
    esc = rows[1]
    busy_cost = esc["cost_usd"] - usd(2.8, esc["price_per_gpu_hour"])
    assert by["escalation: attempts before it"] == pytest.approx(busy_cost - esc["baseline_cost_usd"])
    assert "cannot be told from the ledger" in " ".join(notes)
    assert sum(r["baseline_cost_usd"] for r in rows) + sum(by.values()) == pytest.approx(
        sum(r["cost_usd"] for r in rows)
    )


def test_waterfall_reads_a_ledger_without_the_busy_and_overhead_columns():
    rows = [{**r, "busy_gpu_seconds": None, "overhead_gpu_seconds": None, "kind": None} for r in ledger_rows()[:2]]
    by = dict(savings_steps(ledger_con(rows), "u", "large")[0])
    assert "engine start-up and idle" not in by  # nothing recorded: no bar
    assert by["prefix cache and batching"] == pytest.approx(-(usd(7, LARGE) - usd(6, LARGE)))


ENGINES = {
    "small": {
        "workers": 2,
        "starts": 2,
        "startup_seconds": 20.0,
        "busy_seconds": 90.0,
        "idle_seconds": 10.0,
        "held_seconds": 120.0,
        "held_gpu_seconds": 120.0,
        "utilisation": 0.75,
        "engine_seconds": 90.0,
        "gpu_seconds": 120.0,
        "output_tokens": 4500,
        "uncached_prompt_tokens": 9000,
        "items": 40,
        "model": "m-small",
        "output_tokens_per_second": 50.0,
        "efficiency": {"mfu": None},
        "failed_attempts": 1,
    },
    "large": {
        "workers": 1,
        "starts": 1,
        "startup_seconds": 30.0,
        "busy_seconds": 40.0,
        "idle_seconds": 30.0,
        "held_seconds": 100.0,
        "held_gpu_seconds": 200.0,
        "utilisation": 0.4,
        "engine_seconds": 40.0,
        "gpu_seconds": 200.0,
        "output_tokens": 800,
        "uncached_prompt_tokens": 2000,
        "items": 10,
        "model": "/srv/models/m-large",
        "output_tokens_per_second": 20.0,
        "efficiency": {"mfu": None},
    },
}


def manifest(partition: str = "p0", file: str = "a.jsonl") -> dict:
    return {
        "job_id": "u",
        "status": "succeeded",
        "largest_tier": "large",
        "cost": {
            "cost_usd": 0.0,
            "baseline_cost_usd": 0.0,
            "saved_usd": 0.0,
            "gpu_seconds": 320.0,
            "overhead_gpu_seconds": 130.0,
            "gpu_seconds_by_kind": {"failed_attempt": 3.6, "output": 316.4},
        },
        "engines": ENGINES,
        "counts": {
            "records": 5,
            "outputs": 4,
            "quarantined": 0,
            "by_source": {"generated": 3, "duplicate_in_job": 1},
            "by_reason": {},
            "by_tier": {"small": 2, "large": 2},
        },
        "tokens": {"prompt_tokens": 400, "cached_prompt_tokens": 0, "output_tokens": 80},
        "partitions": {
            partition: {"file": file, "records": 5, "status": "succeeded", "seconds": 3.5},
            "p-short": {"file": "b.jsonl", "records": 1, "status": "succeeded", "seconds": 1.0},
        },
        "reuse": {"verification": {"checked": 0}},
        "routing": {},
    }


def write_job(out, rows: list[dict], m: dict) -> str:
    root = storage.resolve(str(out))
    empty = {
        kind: pa.schema([("partition", pa.string()), *schema]).empty_table()
        for kind, schema in (("outputs", OUTPUTS), ("quarantine", QUARANTINE))
    }
    partition = rows[0]["partition"]
    commit_rows(root, "u", partition, {"ledger": pa.Table.from_pylist(rows, schema=LEDGER), **empty})
    m["cost"].update(
        cost_usd=sum(r["cost_usd"] for r in rows), baseline_cost_usd=sum(r["baseline_cost_usd"] for r in rows)
    )
    storage.write_bytes_atomic(root, root.join("jobs", "u", "manifest.json"), json.dumps(m).encode())
    return str(out)


def svg(page: str, chart_id: str) -> str:
    found = re.search(rf'<svg class="chart" id="{chart_id}" width="([\d.]+)"[^>]*>(.*?)</svg>', page, re.S)
    assert found, f"no chart {chart_id}"
    return found[0]


def test_report_waterfall_bars_utilisation_table_and_whole_partition_labels(tmp_path):
    rows = ledger_rows(LONG_PARTITION)
    page = build_report(write_job(tmp_path / "out", rows, manifest(LONG_PARTITION, LONG_FILE)), "u")

    waterfall = svg(page, "savings")
    bars = re.findall(
        r'<text x="[\d.]+" y="[\d.]+" text-anchor="end">([^<]*)</text><rect class="bar" x="([\d.-]+)" '
        r'y="[\d.]+" width="([\d.-]+)" height="\d+" fill="[^"]+" data-value="([\d.-]+)"/>',
        waterfall,
    )
    labels = [b[0] for b in bars]
    assert labels == [
        "baseline",
        "− reuse: duplicate in job",
        "− routing to smaller tiers",
        "− prefix cache and batching",
        "+ engine start-up and idle",
        "+ escalation: attempts before it",
        "+ failed attempts and lost work",
        "paid",
    ]
    values = {label: float(v) for label, _, _, v in bars}
    assert all(values[label] > 0 for label in labels if label.startswith("+"))  # costs added: bars going up
    assert all(values[label] < 0 for label in labels if label.startswith("−"))  # savings: bars going down
    assert all(float(x) >= 0 and float(w) > 0 for _, x, w, _ in bars)
    assert values["paid"] == pytest.approx(sum(r["cost_usd"] for r in rows))
    assert values["baseline"] + sum(v for k, v in values.items() if k[0] in "+−") == pytest.approx(
        values["paid"], abs=1e-8
    )
    assert "engine start-up and idle (ledger overhead_gpu_seconds × price)" in page

    from tests.system.test_report import cells

    assert cells(page, "engine-utilisation") == [
        ["small", "m-small", "2", "2", "20.0", "90.0", "10.0", "120.0", "120.0", "75.0%", "50", "1"],
        ["large", "m-large", "1", "1", "30.0", "40.0", "30.0", "100.0", "200.0", "40.0%", "20", "0"],
    ]
    assert "130.0 of them start-up and idle" in page and "failed attempt 3.6" in page

    slow = svg(page, "slowest-partitions")
    label = f"{LONG_PARTITION} ({LONG_FILE})"
    text = re.search(r'<text x="([\d.]+)" y="[\d.]+" text-anchor="end"><title>([^<]*)</title>(.*?)</text>', slow)
    assert text and text[2] == label  # the whole label, for a reader hovering it
    lines = re.findall(r'<tspan x="[\d.]+" dy="\d+">([^<]*)</tspan>', text[3])
    assert lines[0] == LONG_PARTITION and "".join(lines[1:]) == f"({LONG_FILE})"  # drawn whole, over lines
    assert all(len(line) <= 56 for line in lines[1:])  # the file broken after '/', never inside a name
    x = float(text[1])
    assert x - max(len(line) for line in lines) * CHAR_W >= 0  # the label column is wide enough for every line
    width = float(re.search(r'width="([\d.]+)"', slow)[1])
    assert x + 100 < width < 1200  # the bars still fit to its right, and the chart stays on a page
    assert f'<text x="{x:.1f}" y="77.4" text-anchor="end">p-short (b.jsonl)</text>' in slow  # short: one line
    drawn = re.findall(r'<rect class="bar" x="[\d.]+" y="([\d.]+)" width="[\d.]+" height="(\d+)"', slow)
    assert float(drawn[1][0]) >= float(drawn[0][0]) + 3 * 14  # the next row starts below the label's lines


def test_run_summary_prints_each_tiers_starts_held_time_and_utilisation():
    m = {**manifest(), "cost": {**manifest()["cost"], "cost_usd": 0.01, "baseline_cost_usd": 0.02, "saved_usd": 0.01}}
    console = Console(width=250, record=True)
    console.print(summary_table(Manifest.parse(m)))
    text = console.export_text()
    assert (
        "2 starts, 120.0 s held (start-up 20.0, busy 90.0, idle 10.0), utilisation 75%, 50 output tok/s, "
        "1 failed attempt"
    ) in text
    assert "1 start, 100.0 s held (start-up 30.0, busy 40.0, idle 30.0), utilisation 40%, 20 output tok/s" in text
    assert "320.000 (130.000 engine start-up and idle)" in text

    old = {**m, "engines": {"small": {"engine_seconds": 2.0, "output_tokens_per_second": 10.0}}}  # before sessions
    console = Console(width=250, record=True)
    console.print(summary_table(Manifest.parse(old)))
    assert "10 output tok/s" in console.export_text()


def test_status_shows_live_tier_workers_and_work_units_per_tier(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/state.db"
    monkeypatch.setenv("TOKENMILL_STATE__URL", url)
    migrate(url)
    state = StateStore(url)
    state.claim_planning("u", "fp", str(tmp_path / "in"), str(tmp_path / "out"))
    queue = UnitQueue(state)
    queue.enqueue("u", "p0", 0, {"small": ["k1", "k2", "k3"], "large": ["k4"]})
    queue.enqueue("u", "p1", 0, {"small": ["k5", "k6"]})
    queue.open_session("s1", "u", "small", "host-a:123", 1, True, startup_seconds=12.0, idle_seconds=0.0)
    assert queue.claim("u", "small", "host-a:123", "s1", 60) is not None  # p0's small unit, leased
    queue.beat_session("s1", busy=30.0, idle=6.0, recorded=25.0)
    queue.open_session("s2", "u", "large", "host-b:7", 2, False, startup_seconds=0.0, idle_seconds=0.0)
    queue.open_session("gone", "u", "large", "host-c:9", 1, True, startup_seconds=5.0, idle_seconds=0.0)
    queue.beat_session("gone", busy=1.0, idle=0.0, recorded=1.0, closed=True)  # closed: not live

    runner = CliRunner()
    out = runner.invoke(app, ["status", "--config", str(TINY_CONFIG), "--job-id", "u", "--format", "json"])
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert got["work_units"] == {
        "large": {"pending": 1, "pending_requests": 1},
        "small": {"leased": 1, "leased_requests": 3, "pending": 1, "pending_requests": 2},
    }
    workers = {w["session_id"]: w for w in got["tier_workers"]}
    assert set(workers) == {"s1", "s2"}
    assert workers["s1"] | {"renewed_seconds_ago": 0} == {
        "job_id": "u",
        "tier": "small",
        "worker": "host-a:123",
        "session_id": "s1",
        "gpus": 1,
        "started_engine": True,
        "held_seconds": 48.0,
        "startup_seconds": 12.0,
        "busy_seconds": 30.0,
        "idle_seconds": 6.0,
        "utilisation": 0.625,
        "renewed_seconds_ago": 0,
    }
    assert workers["s2"]["utilisation"] is None and not workers["s2"]["started_engine"]

    table = runner.invoke(app, ["status", "--config", str(TINY_CONFIG), "--job-id", "u"])
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    small = next(line for line in lines if "host-a:123" in line)
    assert all(cell in small for cell in ("small", "48.0", "12.0", "30.0", "6.0", "62%"))
    depth = next(line for line in lines if line.strip("│ ").startswith("small") and "(3)" in line)
    assert "1 (2)" in depth and "1 (3)" in depth
    assert "host-c:9" not in table.stdout

    monkeypatch.setenv("TOKENMILL_STATE__URL", f"sqlite:///{tmp_path}/other.db")
    migrate(f"sqlite:///{tmp_path}/other.db")
    StateStore(f"sqlite:///{tmp_path}/other.db").claim_planning("v", "fp", "in", "out")
    quiet = runner.invoke(app, ["status", "--config", str(TINY_CONFIG), "--job-id", "v"])
    assert "no work units in the catalog" in quiet.stdout and "no tier worker holds an engine now" in quiet.stdout


def test_headless_progress_lines_say_elapsed_seconds_and_rate(caplog):
    from pipeline.job.progress import Progress

    progress = Progress("log", log_every_seconds=3600)
    with caplog.at_level("INFO", logger="tokenmill.progress"):
        progress.start(10)
        progress.advance(done=4, reused=1, usd=0.5)  # within the interval: no line
        progress.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith(
        "progress: 0/10 done, 0 committed, 0 reused, 0 quarantined, $0.000000; "
    )
    assert re.fullmatch(
        r"progress: 4/10 done, 4 committed, 1 reused, 0 quarantined, \$0\.500000; \d+ s, "
        r"[\d.]+ items/s(, \d+ s left)?",
        lines[1],
    )


def test_items_count_as_done_when_stored_not_when_their_partition_commits():
    """A partition commits after all its waves, so counting at commit said "0/70 done" for minutes."""
    from pipeline.job.progress import Progress

    progress = Progress("off")
    progress.start(10)
    progress.advance(usd=0.1, stored={"p0": 3, "p1": 2})
    assert (progress.shown, progress.done) == (5, 0)
    progress.advance(stored={"p0": 4})  # retries, escalations and chunks are generations too
    progress.advance(done=3, quarantined=1, partition="p0")  # its 4 records replace its 7 stored generations
    assert (progress.shown, progress.done) == (6, 4)
    progress.advance(stored={"p1": 20})
    assert progress.shown == 10  # never past the total


@pytest.mark.parametrize(
    "prefix, tokens, caching, says",
    [
        (
            {"hit_ratio": 0.12, "shareable_ratio": 0.2},
            2000,
            True,
            "12.0% of prompt tokens cached; sharing allows 20.0%",
        ),
        (
            {"hit_ratio": 0.0, "shareable_ratio": 0.046},
            1850,
            True,
            "(about 37 tokens shared per prompt; vLLM caches whole blocks, 128 tokens on a CPU, 16 on a GPU",
        ),
        (
            {"hit_ratio": 0.0, "shareable_ratio": 0.2},
            2000,
            False,
            "(prefix caching is off: tiers.<name>.vllm.enable_prefix_caching)",
        ),
    ],
)
def test_a_prefix_cache_that_hit_nothing_says_why(prefix, tokens, caching, says):
    """The demo said "0.0% cached; sharing allows 4.7%" with no hint why (the demo's shared prefix is shorter than a
    block)."""
    from pipeline.cli.jobs import prefix_line

    m = {
        "job_id": "j",
        "status": "succeeded",
        "prefix_cache": prefix,
        "tokens": {"shareable_prompt_tokens": tokens},
        "counts": {"by_source": {"generated": 50}},
        "engines": {"large": {"levers": {"prefix_caching": caching}}},
    }
    m = Manifest.parse(m)
    assert says in prefix_line(m)
    assert ("(" in prefix_line(m)) == (prefix["hit_ratio"] == 0)
