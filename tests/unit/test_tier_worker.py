"""The tier worker (pipeline/generate/worker.py) on an engine with no model: when it starts, what it drains."""

from __future__ import annotations

from pipeline.config import TierConfig, TokenmillConfig
from pipeline.generate.engine import EnginePool
from pipeline.generate.engine_api import Completion
from pipeline.generate.memory_units import Collected, MemoryUnits
from pipeline.generate.worker import TierWorker
from pipeline.stores.units import WorkUnit
from tests.engines import OneCallEngine


class Echo(OneCallEngine):
    def __init__(self, tier):
        pass

    def generate(self, prompts, max_tokens, sampling):
        return [Completion("ok", len(p), 0, m, "length") for p, m in zip(prompts, max_tokens)]


class FeederFinishesBetweenTheQuestions(Collected):
    """The other tier finishes its last unit while this tier's worker looks: the escalation it enqueued arrives in
    the queue, and from then on nothing more can come (the moment of the Airflow batch test's failed first run)."""

    def __init__(self, rows: dict, queue: MemoryUnits, escalation: WorkUnit):
        super().__init__(rows)
        self.queue, self.escalation = queue, escalation

    def more_may_come(self) -> bool:
        if self.escalation is not None:
            self.queue.pending.append(self.escalation)
            self.escalation = None
        return False


def test_a_unit_enqueued_as_its_feeder_finishes_is_drained_not_left_behind():
    config = TokenmillConfig(
        tiers={"large": TierConfig(model="m-echo", price_per_gpu_hour=1)}, route={"default_tier": "large"}
    )
    unit = WorkUnit(
        job_id="j", unit_id="j/p/1/large", partition="p", tier="large", wave=1, requests=1, status="pending", epoch=0
    )
    row = {
        "prompt_token_ids": [1, 2, 3],
        "max_tokens": 4,
        "generation": {"item_key": "k", "id": "d", "tenant": "t", "scope": "s", "text": "doc"},
    }
    queue = MemoryUnits([])  # empty when the worker first looks
    job = FeederFinishesBetweenTheQuestions({unit.unit_id: [row]}, queue, unit)
    report = TierWorker(config, "large", "j", queue, EnginePool(config.tiers, factory=Echo), "w", job).drain()
    assert report.units == 1 and list(job.items) == ["k"]


def test_busy_shares_add_up_to_every_busy_second_and_weigh_each_token_once():
    """The array shares (worker.BusyShares): a prefill weighed once, less its cached tokens, each output token once;
    an interval with nothing visible shared evenly; every second of every interval on some request."""
    from pipeline.config import CostConfig
    from pipeline.generate.engine_api import Completion, Progressed
    from pipeline.generate.worker import BusyShares

    cost = CostConfig()
    shares, seconds = BusyShares(cost), {}
    for i in range(100):  # more than the arrays' first size: they grow, and freed slots are used again
        shares.add(f"r{i}", 10 + i)
    shares.share(2.0, [], [])  # a prefill in progress, nothing shown: evenly
    done = Completion("x", 10, 4, 1, "stop")
    first = [Progressed("r0", 1, done)] + [Progressed(f"r{i}", 1, None) for i in range(1, 100)]
    shares.share(3.0, first, first[:1])
    seconds["r0"] = shares.pop("r0")
    w0 = cost.prefill_token_weight * (10 - 4) + cost.cached_token_weight * 4 + cost.decode_token_weight
    weights = [w0] + [cost.prefill_token_weight * (10 + i) + cost.decode_token_weight for i in range(1, 100)]
    assert abs(seconds["r0"] - (2.0 / 100 + 3.0 * w0 / sum(weights))) < 1e-12
    for i in range(100, 150):  # into r0's slot and new ones
        shares.add(f"r{i}", 5)
    # A decode step: r1..r99 one token each (their prefill weighed already), r100.. prefilled; and an id not in flight.
    step = [Progressed(f"r{i}", 2, None) for i in range(1, 100)] + [
        Progressed(f"r{i}", 1, None) for i in range(100, 150)
    ]
    shares.share(1.5, step + [Progressed("gone", 3, None)], [])
    decode, prefill = cost.decode_token_weight, cost.prefill_token_weight * 5 + cost.decode_token_weight
    total = 99 * decode + 50 * prefill
    seconds |= {rid: shares.pop(rid) for rid in list(shares.slot)}
    assert abs(seconds["r120"] - 1.5 * prefill / total) < 1e-12
    assert abs(sum(seconds.values()) - (2.0 + 3.0 + 1.5)) < 1e-12
    assert not shares.slot and len(shares.free) == len(shares.seconds)
