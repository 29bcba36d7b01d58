"""Route: choose the tier that generates each item, and say why.

Rules decide first (in order; the first whose conditions all hold), then the learned router if one
is configured (router.py), then `route.default_tier`. Every item gets `tier` and `route_reason`
(`rule:<name>`, `router:<p>` with the router's probability that the small tier suffices, or
`default`), which the ledger keeps.
"""

from __future__ import annotations

import json
import re

import pyarrow as pa

from pipeline.config import RouteConfig, RouteRule


def rule_matches(rule: RouteRule, text: str, tenant: str, metadata: dict, pattern: re.Pattern | None) -> bool:
    if rule.min_chars is not None and len(text) < rule.min_chars:
        return False
    if rule.max_chars is not None and len(text) > rule.max_chars:
        return False
    if rule.tenants and tenant not in rule.tenants:
        return False
    if any(metadata.get(k) != v for k, v in rule.metadata.items()):
        return False
    return pattern is None or pattern.search(text) is not None


def assign_tiers(
    records: pa.Table, config: RouteConfig, router=None, fixed: list[str | None] | None = None
) -> pa.Table:
    """Add `tier` and `route_reason`. `router`: a loaded Router (router.py) or None. `fixed`: per row, a tier
    already chosen (the one a batch request's `model` names: reason `model`), or None."""
    patterns = [re.compile(r.regex) if r.regex else None for r in config.rules]
    texts, tenants = records["text"].to_pylist(), records["tenant"].to_pylist()
    metadata = records["metadata"].to_pylist() if "metadata" in records.column_names else [None] * len(texts)
    tiers: list[str | None] = [None] * len(texts)
    reasons: list[str | None] = [None] * len(texts)
    for i, tier in enumerate(fixed or ()):
        if tier is not None:
            tiers[i], reasons[i] = tier, "model"
    for i, (text, tenant, meta) in enumerate(zip(texts, tenants, metadata)):
        if tiers[i] is not None:
            continue
        meta_dict = json.loads(meta) if meta and config.rules else {}
        for rule, pattern in zip(config.rules, patterns):
            if rule_matches(rule, text, tenant, meta_dict if isinstance(meta_dict, dict) else {}, pattern):
                tiers[i], reasons[i] = rule.tier, f"rule:{rule.name}"
                break
    undecided = [i for i, t in enumerate(tiers) if t is None]
    if router is not None and undecided:
        for i, (tier, p) in zip(undecided, router.route([texts[i] for i in undecided])):
            tiers[i], reasons[i] = tier, f"router:{p:.3f}"
    for i in undecided:
        if tiers[i] is None:
            tiers[i], reasons[i] = config.default_tier, "default"
    return records.append_column("tier", pa.array(tiers, pa.string())).append_column(
        "route_reason", pa.array(reasons, pa.string())
    )
