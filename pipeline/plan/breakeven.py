"""At what nightly volume self-hosting beats the API batch offers (`tokenmill estimate --hardware ... --volume N`).

A night's self-hosted cost, per tier of a mix: one engine start-up (projected on the what-if's hardware), the busy
time of its share of the night's documents (projected at that volume: batches fill as the volume grows) over the
engines' utilisation (busy ÷ (busy + idle), measured in the user's ledger when there is one), times its GPUs and
their price. The API's cost: the same requests' prompt, cached prompt and output tokens at each batch offer's prices
(`api_prices.json`, dated, or a file the user edits). The break-even volume is where the two are equal; below it
the start-ups dominate and the API is cheaper.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

_VOLUME = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([kKmM]?)\s*(?:/\s*night)?\s*$")
MAX_VOLUME = 1e12  # documents per night past which no break-even is searched


def parse_volume(text: str) -> int:
    """`100000`, `100k/night`, `2.5M`, `1e6` -> documents per night."""
    m = _VOLUME.match(str(text))
    if not m:
        raise ValueError(f"--volume {text!r}: a number of documents per night, e.g. 100000, 100k/night or 2.5M")
    n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6}[m.group(2).lower()]
    if not 1 <= n <= MAX_VOLUME:
        raise ValueError(f"--volume {text!r}: between 1 and {MAX_VOLUME:.0e} documents per night")
    return round(n)


@dataclass(frozen=True)
class TierLoad:
    """One tier of a mix per document of the night: its requests, their mean prompt and output tokens, and how
    its engines are held. `busy(items)`: projected busy engine seconds of `items` requests."""

    name: str
    items_per_doc: float
    prompt: float
    output: float
    busy: Callable[[float], float]
    startup_seconds: float
    utilisation: float
    gpus: int
    price_per_gpu_hour: float
    billed_seconds: float = 0.0  # the least a GPU is paid for per night (a reserved GPU: 24 h), whatever it runs

    def held_seconds(self, docs: float) -> float:
        """Seconds each of the tier's GPUs is paid for in a night of `docs` documents."""
        items = self.items_per_doc * docs
        held = self.startup_seconds + self.busy(items) / self.utilisation if items > 0 else 0.0
        return max(held, self.billed_seconds)

    def usd(self, docs: float) -> float:
        """The tier's night at `docs` documents: start-up, then busy time over utilisation, on all its GPUs."""
        return self.held_seconds(docs) * self.gpus * self.price_per_gpu_hour / 3600

    def api_usd_per_doc(self, prices: dict, cached_share: float) -> float:
        prompt = self.prompt * ((1 - cached_share) * prices["input"] + cached_share * prices["cached_input"])
        return self.items_per_doc * (prompt + self.output * prices["output"]) / 1e6


def night_usd(tiers: list[TierLoad], docs: float) -> float:
    return sum(t.usd(docs) for t in tiers)


def break_even(tiers: list[TierLoad], api_per_doc: float) -> float | None:
    """Documents per night at which the mix costs what the API does (bisection on the projected night, which is
    start-ups plus busy time growing with volume); None when self-hosting costs more even at MAX_VOLUME."""
    gap = lambda n: night_usd(tiers, n) - api_per_doc * n  # noqa: E731
    if gap(MAX_VOLUME) > 0:
        return None
    if gap(1.0) <= 0:
        return 1.0
    low, high = 0.0, math.log(MAX_VOLUME)
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if gap(math.exp(mid)) > 0 else (low, mid)
    return math.exp(high)


def mix_figures(tiers: list[TierLoad], job_docs: float, volume: float, api: dict[str, dict], cached: float) -> dict:
    """$/1k documents at the job's volume and at `volume`, the night's fixed cost, and per API offer its $/1k, the
    break-even volume and the ratio self-hosted ÷ API at `volume`."""
    at_volume = night_usd(tiers, volume)
    offers = {}
    for name, prices in sorted(api.items()):
        per_doc = sum(t.api_usd_per_doc(prices, cached) for t in tiers)
        offers[name] = {
            "usd_per_1k_documents": per_doc * 1000,
            "break_even_documents": break_even(tiers, per_doc),
            "ratio_at_volume": at_volume / (per_doc * volume) if per_doc else None,
        }
    return {
        "tiers": [t.name for t in tiers if t.items_per_doc > 0],
        "usd_per_1k_documents_at_job": night_usd(tiers, job_docs) / job_docs * 1000 if job_docs else None,
        "usd_per_1k_documents_at_volume": at_volume / volume * 1000,
        "usd_per_night_at_volume": at_volume,
        "fixed_usd_per_night": sum(
            max(t.startup_seconds, t.billed_seconds) * t.gpus * t.price_per_gpu_hour / 3600 for t in tiers
        ),
        "gpu_hours_per_night_at_volume": sum(t.held_seconds(volume) * t.gpus / 3600 for t in tiers),
        # a tier whose GPUs would run past 24 h needs more of them: the figures at `volume` assume it has them
        "fits_a_night": all(t.held_seconds(volume) <= 86400 for t in tiers),
        "api": offers,
    }


def curve(tiers: list[TierLoad], api_per_doc: dict[str, float], low: float, high: float, points: int = 25) -> dict:
    """$/document against documents per night, log-spaced from `low` to `high`: the mix and each API offer."""
    step = (math.log(high) - math.log(low)) / max(points - 1, 1)
    volumes = [math.exp(math.log(low) + i * step) for i in range(points)]
    return {
        "volumes": volumes,
        "self_hosted": [night_usd(tiers, n) / n for n in volumes],
        "api": {name: [a] * points for name, a in api_per_doc.items()},
    }


def measured_utilisation(config, output_uri: str | None) -> dict[str, tuple[float, int]]:
    """Per tier, busy ÷ (busy + idle) of its engines over the latest jobs' manifests under `output_uri` (start-up
    left out: it is counted once per night on its own), and how many jobs measured it; {} without a ledger."""
    from pipeline.output.ledger import connect
    from pipeline.output.manifest import read_manifest
    from pipeline.plan.rates import RECENT_JOBS
    from pipeline.stores import storage

    if not output_uri:
        return {}
    try:
        jobs = connect(output_uri, config.storage).execute(
            "SELECT job_id FROM ledger WHERE source = 'generated' GROUP BY 1 ORDER BY max(created_at) DESC LIMIT ?",
            [RECENT_JOBS],
        )
        root = storage.resolve(output_uri, config.storage)
        manifests = [read_manifest(root, job) for (job,) in jobs.fetchall()]
    except Exception:  # no readable ledger or manifest (a first night): utilisation stays projected
        return {}
    sums: dict[str, list[float]] = {}
    for m in manifests:
        for tier, e in m.engines.items():
            busy, idle = e.busy_seconds, e.idle_seconds
            if busy > 0:
                s = sums.setdefault(tier, [0.0, 0.0, 0])
                s[0], s[1], s[2] = s[0] + busy, s[1] + idle, s[2] + 1
    return {t: (b / (b + i), int(n)) for t, (b, i, n) in sums.items()}
