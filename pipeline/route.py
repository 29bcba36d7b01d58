"""Stage 4, route: choose the tier that generates each item.

For now every item goes to `route.default_tier`; rules and a learned router plug in here and
keep the same contract: one `tier` per record, a key of `config.tiers`.
"""

from __future__ import annotations

import pyarrow as pa

from pipeline.config import RouteConfig


def assign_tiers(records: pa.Table, config: RouteConfig) -> pa.Table:
    return records.append_column("tier", pa.array([config.default_tier] * records.num_rows, pa.string()))
