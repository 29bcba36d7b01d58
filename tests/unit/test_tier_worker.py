"""The tier worker (pipeline/generate/worker.py) on an engine with no model: when it starts, what it drains."""

from __future__ import annotations

from pipeline.config import TierConfig, TokenmillConfig
from pipeline.generate.engine import EnginePool
from pipeline.generate.engine_api import Completion
from pipeline.generate.memory_units import Collected, MemoryUnits
from pipeline.generate.worker import TierWorker
from pipeline.stores.units import WorkUnit


class Echo:
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
