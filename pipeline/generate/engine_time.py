"""What the engines' held time comes to, per partition: the shares a commit writes into its ledger.

Every second an engine session held is start-up, busy or idle (worker.py). A commit waits until the
job's live sessions have closed (their figures are final), then shares each session's start-up and idle
time over the items it generated (pricing.session_shares), and charges the partition what no output
carries: its failed attempts and its part of the work lost with dead workers.
"""

from __future__ import annotations

import logging
import time

from pipeline.config import TokenmillConfig
from pipeline.generate.pricing import session_shares
from pipeline.stores.catalog import StateStore
from pipeline.stores.lease import worker_is_gone
from pipeline.stores.units import UnitQueue

log = logging.getLogger(__name__)


class EngineTime:
    def __init__(self, config: TokenmillConfig, job_id: str, state: StateStore, queue: UnitQueue):
        self.config, self.job_id, self.state, self.queue = config, job_id, state, queue

    def stale(self):
        """A session is stale (its worker died) when it is still open and its lease ran out, or its worker is
        provably gone."""
        t = self.state.db_now()
        return lambda s: (
            s.status != "closed" and (s.lease_expires_at is None or s.lease_expires_at < t or worker_is_gone(s.worker))
        )

    def wait_for_engines(self, still_held) -> None:
        """Wait while another worker's engine session of this job is open: the start-up and idle time a
        commit shares into its ledger must be final. `still_held()`: False once this commit's claim is lost."""
        announced = False
        while still_held():
            stale = self.stale()
            live = [s for s in self.queue.sessions(self.job_id) if s.status != "closed" and not stale(s)]
            if not live:
                return
            if not announced:
                log.info(
                    "commit waits for %d engine sessions of this job to close (%s)",
                    len(live),
                    ", ".join(s.session_id for s in live),
                )
                announced = True
            time.sleep(self.config.state.wait_seconds)

    def shares(self) -> dict:
        """Per engine session of this job: how its held GPU-seconds are shared (pricing.session_shares)."""
        return session_shares(
            self.queue.sessions(self.job_id), self.queue.recorded_by_session(self.job_id), self.stale()
        )

    def charges(self, partition: str, shares: dict) -> list[dict]:
        """This partition's GPU time no output carries: its failed attempts, with their overhead share; its
        share of the work lost with dead workers (pro rata to the requests of the claims they did not
        finish); and, whole, the lost time of a session with no such claim that no partition carries yet
        (it generated nothing: another worker took its units first, or it died before its first)."""
        tiers = {s.session_id: s.tier for s in self.queue.sessions(self.job_id)}
        weights = {sid: self.lost_weights(sid) for sid, share in shares.items() if share.lost > 0}
        # One charge row per such session, taken by the first partition that commits after it ended: every
        # other commit finds it taken (a share over every partition missed those committed before it began).
        self.queue.add_charges(
            self.job_id,
            [
                {
                    "charge_id": f"{sid}/unused",
                    "partition": partition,
                    "session_id": sid,
                    "kind": "lost",
                    "id": None,
                    "tenant": None,
                    "tier": tiers[sid],
                    "gpu_seconds": shares[sid].lost,
                }
                for sid, w in weights.items()
                if not w
            ],
        )
        out = [
            {
                **ch,
                "busy_gpu_seconds": ch["gpu_seconds"],
                "overhead_gpu_seconds": ch["gpu_seconds"] * shares[ch["session_id"]].overhead_ratio
                if ch["session_id"] in shares and ch["kind"] != "lost"
                else 0.0,
            }
            for ch in self.queue.charges(self.job_id, partition)
        ]
        for sid, w in weights.items():
            total, mine = sum(w.values()), w.get(partition, 0)
            if total and mine:
                out.append(
                    {
                        "partition": partition,
                        "session_id": sid,
                        "kind": "lost",
                        "id": None,
                        "tenant": None,
                        "tier": tiers[sid],
                        "busy_gpu_seconds": shares[sid].lost * mine / total,
                        "overhead_gpu_seconds": 0.0,
                    }
                )
        return out

    def lost_weights(self, session_id: str) -> dict[str, int]:
        """Per partition, its part of the work a dead session lost: the requests of the claims it did not
        finish (empty when it has none). Fixed once the session is dead, so every partition's commit shares
        the same whole, however the units change hands after."""
        weights: dict[str, int] = {}
        for claim in self.queue.unfinished_claims(self.job_id, session_id):
            weights[claim.partition] = weights.get(claim.partition, 0) + claim.requests
        return weights

    @staticmethod
    def overhead_ratio(shares: dict):
        def ratio(item: dict) -> float:
            share = shares.get(item.get("session_id"))
            return share.overhead_ratio if share is not None else 0.0

        return ratio
