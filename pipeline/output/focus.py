"""The ledger as FOCUS 1.2 cost and usage rows, for FinOps tools (`tokenmill ledger export --format focus`).

FOCUS (FinOps Open Cost and Usage Specification) is the column set FinOps tools ingest from every provider.
`to_focus` is a pure function: a ledger table (schema.LEDGER) and a basis in, a FOCUS table out, one row per
ledger row, in the same order. Reused rows (cost 0, no GPU time) and every charge row (`invalid_output`,
`failed_attempt`, `lost`) are there too, so a FOCUS file adds up to what the ledger does.

Two bases, as OpenCost names them:
- `allocation`: every GPU-second the engines were held, start-up and idle shares included (`gpu_seconds`).
  It reconciles to the bill: per row, cost = `cost_usd`.
- `usage`: busy time only (`busy_gpu_seconds`), priced `busy_gpu_seconds × price_per_gpu_hour / 3600`. It is
  computed as the row's busy share of its recorded cost, `cost_usd × busy_gpu_seconds / gpu_seconds`, which is
  the same amount because the ledger keeps `cost_usd = gpu_seconds × price_per_gpu_hour / 3600` on every row
  (blended price for two-tier rows); taking the share of the recorded cost keeps usage ≤ allocation on every
  row and makes it equal where there is no overhead, with no float noise in between. A row with no GPU
  time, or a ledger written before `busy_gpu_seconds` (its `gpu_seconds` was busy time only), is all busy.
  allocation − usage is the overhead share (`overhead_gpu_seconds` × price / 3600): in both files as
  `x_OverheadCost`, beside `x_BusyCost`.

Money is exact. FOCUS types costs as Decimal: they are decimal128(38, 18) here, each rounded once, half to
even, from the exact value of the ledger's floats (integer arithmetic, no float step):
  allocation = round18(cost_usd)
  usage      = round18(cost_usd × busy_gpu_seconds / gpu_seconds)
  overhead   = allocation − usage        (exact: no rounding)
so per row busy + overhead == allocation, and per file sum(allocation) == sum(round18(cost_usd)) over the
ledger rows exported, exactly: the same as pyarrow's cast of `cost_usd` to decimal128(38, 18) (an exact
rounding). `tokenmill ledger summary` sums DuckDB's `CAST(cost_usd AS DECIMAL(38, 18))`, which rounds through a
double and can differ in the 18th decimal place per row: to the cent and far below, the totals are the same.
BilledCost = EffectiveCost = ListCost = ContractedCost on every row: tokenmill's price per GPU-hour is its list
price, with no discount, commitment or amortisation. ListUnitPrice × PricingQuantity gives ListCost to within the
18th-place rounding of its two factors: the cost is what is kept exact, since it is what must add up.

Tokens are columns, not rows: `x_PromptTokens`, `x_CachedPromptTokens` and `x_OutputTokens` on the GPU row.
What tokenmill prices is GPU time (PricingUnit and ConsumedUnit `GPU-Hours`), and tokens are what that time
made. Extra zero-cost rows with ConsumedUnit `Tokens` would triple the row count, make row counts and
`ChargeCategory = 'Usage'` counts disagree with the ledger, and sit in every FinOps tool's "usage" views as
charges of 0 that a sum over ConsumedQuantity mixes with GPU-hours; as columns, cost is counted exactly once
per ledger row by construction and tokens join nothing.

Tags (FOCUS Key-Value Format: a JSON object as text) carry the row's tenant, job, partition, tier, model,
adapter, item id, route reason, source and kind, null ones left out. They are provider-defined tags, which
FOCUS requires to carry a provider prefix: every key starts with `tokenmill/` (e.g. `tokenmill/tenant`).
The same values are in plain columns too (SubAccountId = tenant, `x_JobId`, `x_ItemId`, ...) for SQL.

Billing and charge periods are the UTC day of the row's `created_at` (when its partition was committed):
[00:00Z, next day 00:00Z).
"""

from __future__ import annotations

import json
from datetime import datetime, time, timedelta, timezone
from decimal import Decimal

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.output.ledger import LedgerError, ledger_where

BASES = ("allocation", "usage")
SCALE = 18
MONEY = pa.decimal128(38, SCALE)  # FOCUS Decimal: 20 integer digits, 18 decimal places
DATETIME = pa.timestamp("us", tz="UTC")  # FOCUS Date/Time Format: UTC
TAG_PREFIX = "tokenmill/"  # FOCUS: provider-defined tag keys carry a provider prefix (documented in docs/analyst.md)

# The columns FOCUS 1.2 makes Mandatory in a cost and usage dataset (presence rules without a condition), with
# their FOCUS data type. Source: the FOCUS 1.2 requirements model,
# https://github.com/FinOps-Open-Cost-and-Usage-Spec/FOCUS_Spec/blob/main/specification/requirements_model/model_rules/datasets/costandusage.json
# (rules CostAndUsage-D-0xx-M), and the specification text, https://focus.finops.org/focus-specification/v1-2/
MANDATORY = {
    "BilledCost": "Decimal",
    "BillingAccountId": "String",
    "BillingAccountName": "String",
    "BillingCurrency": "String",
    "BillingPeriodEnd": "DateTime",
    "BillingPeriodStart": "DateTime",
    "ChargeCategory": "String",
    "ChargeClass": "String",
    "ChargeDescription": "String",
    "ChargePeriodEnd": "DateTime",
    "ChargePeriodStart": "DateTime",
    "ContractedCost": "Decimal",
    "EffectiveCost": "Decimal",
    "InvoiceIssuerName": "String",
    "ListCost": "Decimal",
    "PricingQuantity": "Decimal",
    "PricingUnit": "String",
    "ProviderName": "String",
    "PublisherName": "String",
    "ServiceCategory": "String",
    "ServiceName": "String",
}
# Conditional columns whose condition holds here (usage is measured, unit prices are published, tenants are sub
# accounts, engines are resources, tags exist) and the Recommended ones (ChargeFrequency, InvoiceId,
# ServiceSubcategory: the FinOps focus-validator's `-O` rules for FOCUS 1.2).
CONDITIONAL = {
    "ChargeFrequency": "String",
    "InvoiceId": "String",
    "ConsumedQuantity": "Decimal",
    "ConsumedUnit": "String",
    "ContractedUnitPrice": "Decimal",
    "ListUnitPrice": "Decimal",
    "PricingCategory": "String",
    "ResourceId": "String",
    "ResourceName": "String",
    "ResourceType": "String",
    "ServiceSubcategory": "String",
    "SubAccountId": "String",
    "SubAccountName": "String",
    "Tags": "JSON",
}
ARROW_TYPES = {"Decimal": MONEY, "DateTime": DATETIME, "String": pa.string(), "JSON": pa.string()}
# Custom columns (FOCUS: an `x_` prefix, after every FOCUS column).
CUSTOM = [
    ("x_Basis", pa.string()),
    ("x_JobId", pa.string()),
    ("x_Partition", pa.string()),
    ("x_ItemId", pa.string()),
    ("x_Kind", pa.string()),
    ("x_Source", pa.string()),
    ("x_Tier", pa.string()),
    ("x_Model", pa.string()),
    ("x_BusyGpuSeconds", pa.float64()),
    ("x_OverheadGpuSeconds", pa.float64()),
    ("x_BusyCost", MONEY),
    ("x_OverheadCost", MONEY),
    ("x_PromptTokens", pa.int64()),
    ("x_CachedPromptTokens", pa.int64()),
    ("x_OutputTokens", pa.int64()),
]
# FOCUS columns first, in name order, then the custom ones. A Mandatory column that FOCUS allows no null in is
# declared non-nullable, so the Parquet file says so too (ChargeClass is null on every row that is no correction).
FOCUS = pa.schema(
    [
        pa.field(name, ARROW_TYPES[kind], nullable=name not in MANDATORY or name == "ChargeClass")
        for name, kind in sorted({**MANDATORY, **CONDITIONAL}.items())
    ]
    + CUSTOM
)

# What tokenmill is, in FOCUS's terms: it provides, publishes and bills its own service (self-hosted).
PROVIDER = "tokenmill"
SERVICE_NAME = "tokenmill batch summarisation"
SERVICE_CATEGORY = "AI and Machine Learning"
SERVICE_SUBCATEGORY = "Generative AI"
UNIT = "GPU-Hours"  # FOCUS Unit Format: <singular-base-unit>-<plural-base-unit>
LEDGER_COLUMNS = (
    "job_id",
    "partition",
    "id",
    "tenant",
    "tier",
    "model",
    "adapter",
    "route_reason",
    "source",
    "kind",
    "prompt_tokens",
    "cached_prompt_tokens",
    "output_tokens",
    "gpu_seconds",
    "busy_gpu_seconds",
    "overhead_gpu_seconds",
    "price_per_gpu_hour",
    "cost_usd",
)


class FocusError(LedgerError):
    """A ledger that cannot be exported as asked; the message says why."""


def exact(value: float | None, column: str) -> tuple[int, int]:
    """The exact value of a ledger float (null: 0) as (numerator, denominator > 0); NaN or infinity is refused."""
    try:
        return (value or 0.0).as_integer_ratio()
    except (ValueError, OverflowError):
        raise FocusError(f"a ledger row has {column} = {value}, which no bill can hold") from None


def round18(numerator: int, denominator: int) -> Decimal:
    """numerator / denominator (denominator > 0) rounded half to even to 18 decimal places, in integers: exact."""
    q, r = divmod(numerator * 10**SCALE, denominator)  # floor division: 0 <= r < denominator
    if 2 * r > denominator or (2 * r == denominator and q % 2):
        q += 1
    return Decimal(q).scaleb(-SCALE)


def split_cost(cost_usd: float | None, gpu_seconds: float | None, busy_gpu_seconds: float | None) -> tuple:
    """(allocation, usage, overhead) of one ledger row, as Decimals with busy + overhead == allocation exactly."""
    cost, gpu = exact(cost_usd, "cost_usd"), exact(gpu_seconds, "gpu_seconds")
    busy = gpu if busy_gpu_seconds is None else exact(busy_gpu_seconds, "busy_gpu_seconds")
    allocation = round18(*cost)
    if gpu[0] <= 0:  # no GPU time: nothing to share out
        return allocation, allocation, allocation - allocation
    # cost × busy / gpu, as one fraction of integers, rounded once
    usage = round18(cost[0] * busy[0] * gpu[1], cost[1] * busy[1] * gpu[0])
    return allocation, usage, allocation - usage


def charge_description(row: dict, basis: str) -> str:
    """What the row paid for, in a sentence with no ids in it (so descriptions group well)."""
    engine = f"tier {row['tier']} ({row['model']})"
    what = {
        "invalid_output": f"GPU time on {engine} for an output that was then quarantined",
        "failed_attempt": f"GPU time on {engine} of a request the engine failed on",
        "lost": f"GPU time on {engine} lost with a tier worker that died (no record owns it)",
        "unfinished": f"GPU time on {engine} for a request its stopped job left unanswered",
        "judge": f"GPU time on {engine} judging a summary (checks.judge)",
    }.get(row["kind"])
    if what is None:
        if (
            row["source"] not in (None, "generated") and not row["gpu_seconds"]
        ):  # a reused output's paid attempt has time
            return f"Summary reused ({row['source']}) from an earlier generation on {engine}: no GPU time"
        what = f"GPU time on {engine} that generated a summary"
    time_share = "busy time only" if basis == "usage" else "busy time and its share of engine start-up and idle"
    return f"{what}; {time_share}"


def tags(row: dict) -> str:
    """The row's FOCUS Tags: a JSON object of its non-null labels, keys prefixed `tokenmill/`."""
    labels = {
        "tenant": row["tenant"],
        "job": row["job_id"],
        "partition": row["partition"],
        "tier": row["tier"],
        "model": row["model"],
        "adapter": row["adapter"],
        "item": row["id"],
        "route_reason": row["route_reason"],
        "source": row["source"],
        "kind": row["kind"],
    }
    return json.dumps({TAG_PREFIX + k: v for k, v in labels.items() if v is not None}, ensure_ascii=False)


def day_of(created_at: datetime | None) -> tuple[datetime, datetime]:
    """[start, end) of the UTC day holding `created_at`: the row's billing and charge period."""
    if created_at is None:
        raise FocusError("a ledger row has no created_at: its billing period is unknown")
    start = datetime.combine(created_at.astimezone(timezone.utc).date(), time(), tzinfo=timezone.utc)
    return start, start + timedelta(days=1)


def focus_row(row: dict, basis: str, account: str) -> dict:
    """One ledger row (a dict of LEDGER_COLUMNS plus `created_at`) as one FOCUS row."""
    allocation, usage, overhead = split_cost(row["cost_usd"], row["gpu_seconds"], row["busy_gpu_seconds"])
    cost = allocation if basis == "allocation" else usage
    gpu = row["gpu_seconds"] or 0.0
    seconds = gpu if basis == "allocation" or row["busy_gpu_seconds"] is None else row["busy_gpu_seconds"]
    numerator, denominator = exact(seconds, "gpu_seconds")
    hours = round18(numerator, denominator * 3600)
    price = round18(*exact(row["price_per_gpu_hour"], "price_per_gpu_hour"))
    start, end = day_of(row["created_at"])
    engine = None if row["tier"] is None and row["model"] is None else f"{row['tier']}/{row['model']}"
    return {
        "BilledCost": cost,
        "BillingAccountId": account,
        "BillingAccountName": account,
        "BillingCurrency": "USD",
        "BillingPeriodEnd": end,
        "BillingPeriodStart": start,
        "ChargeCategory": "Usage",
        "ChargeClass": None,  # FOCUS: null unless the row corrects an earlier billing period
        "ChargeDescription": charge_description(row, basis),
        "ChargeFrequency": "Usage-Based",
        "ChargePeriodEnd": end,
        "ChargePeriodStart": start,
        "ConsumedQuantity": hours,
        "ConsumedUnit": UNIT,
        "ContractedCost": cost,
        "ContractedUnitPrice": price,
        "EffectiveCost": cost,
        "InvoiceIssuerName": PROVIDER,
        # FOCUS: null while a charge is on no issued invoice. tokenmill issues none: its rows feed the invoice
        # whoever bills the tenants issues, which then carries that invoice's id.
        "InvoiceId": None,
        "ListCost": cost,
        "ListUnitPrice": price,
        "PricingCategory": "Standard",
        "PricingQuantity": hours,
        "PricingUnit": UNIT,
        "ProviderName": PROVIDER,
        "PublisherName": PROVIDER,
        "ResourceId": engine,
        "ResourceName": None if engine is None else f"tier {row['tier']} ({row['model']})",
        "ResourceType": "LLM engine tier",
        "ServiceCategory": SERVICE_CATEGORY,
        "ServiceName": SERVICE_NAME,
        "ServiceSubcategory": SERVICE_SUBCATEGORY,
        "SubAccountId": row["tenant"],
        "SubAccountName": row["tenant"],
        "Tags": tags(row),
        **custom_columns(row, basis, usage, overhead),
    }


def custom_columns(row: dict, basis: str, busy_cost: Decimal, overhead_cost: Decimal) -> dict:
    return {
        "x_Basis": basis,
        "x_JobId": row["job_id"],
        "x_Partition": row["partition"],
        "x_ItemId": row["id"],
        "x_Kind": row["kind"],
        "x_Source": row["source"],
        "x_Tier": row["tier"],
        "x_Model": row["model"],
        "x_BusyGpuSeconds": row["busy_gpu_seconds"],
        "x_OverheadGpuSeconds": row["overhead_gpu_seconds"],
        "x_BusyCost": busy_cost,
        "x_OverheadCost": overhead_cost,
        "x_PromptTokens": row["prompt_tokens"],
        "x_CachedPromptTokens": row["cached_prompt_tokens"],
        "x_OutputTokens": row["output_tokens"],
    }


def to_focus(ledger: pa.Table, basis: str = "allocation", account: str = PROVIDER) -> pa.Table:
    """FOCUS 1.2 rows (schema FOCUS) for the rows of `ledger` (schema.LEDGER's columns), one per ledger row.

    `basis`: `allocation` (cost = `cost_usd`) or `usage` (busy share only); the module docstring says how
    both are computed and how they reconcile. `account`: the BillingAccountId and BillingAccountName."""
    if basis not in BASES:
        raise FocusError(f"basis must be {' or '.join(BASES)}, not {basis}")
    missing = [c for c in (*LEDGER_COLUMNS, "created_at") if c not in ledger.column_names]
    if missing:
        raise FocusError(f"not a ledger table: no column {', '.join(missing)}")
    # Only the instant matters; a reader (DuckDB) may hand timestamps back in its session's time zone.
    created = ledger["created_at"].cast(DATETIME)
    rows = ledger.select(list(LEDGER_COLUMNS)).append_column("created_at", created).to_pylist()
    return pa.Table.from_pylist([focus_row(r, basis, account) for r in rows], schema=FOCUS)


def csv_ready(focus: pa.Table) -> pa.Table:
    """`focus` with its date/time columns as FOCUS Date/Time Format text (`2026-11-20T00:00:00Z`), for CSV:
    Arrow's CSV writer would print `2026-11-20 00:00:00.000000Z`, which is not ISO 8601."""
    for i, field in enumerate(focus.schema):
        if pa.types.is_timestamp(field.type):
            # whole seconds: %S of a microsecond timestamp would print its fraction too
            seconds = focus[field.name].cast(pa.timestamp("s", tz="UTC"), safe=False)
            text = pc.strftime(seconds, format="%Y-%m-%dT%H:%M:%SZ")
            focus = focus.set_column(i, pa.field(field.name, pa.string()), text)
    return focus


def export_sql(job_id: str | None = None, tenant: str | None = None, since=None, until=None) -> tuple[str, list]:
    """SQL over the `ledger` view (pipeline.output.ledger.connect) for the rows to export, in a stable order."""
    where, params = ledger_where(job_id, tenant, since, until)
    sql = f"SELECT {', '.join((*LEDGER_COLUMNS, 'created_at'))} FROM ledger{where}"
    return sql + " ORDER BY created_at, job_id, partition, kind, id", params


def read_ledger(con, job_id: str | None = None, tenant: str | None = None, since=None, until=None) -> pa.Table:
    """The ledger rows to export, from a connection made by pipeline.output.ledger.connect."""
    sql, params = export_sql(job_id, tenant, since, until)
    return con.sql(sql, params=params).to_arrow_table()
