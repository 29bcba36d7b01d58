"""The tier worker: one tier's engine, started once and kept fed with that tier's work units from
every partition of a job, until no unit of the tier is left or can still arrive.

  loop: claim units while fewer than `fill` requests are in flight -> engine step -> share its seconds ->
        record what finished (price, check, store, cache: in batches) -> finish units whose requests are all
        stored -> renew leases

The engine runs vLLM's own loop (add_request / step), so requests join the running batch as others
finish and the scheduler always has work to choose from while any remains. Every second the engine
is held is start-up, busy (requests in flight) or idle (none), measured here and renewed into the
engine session (stores/units.py); each busy interval is shared among the requests in flight by the
token weight of what it advanced (prefill the first time a request shows output, decode per token),
so the items' busy GPU-seconds add up exactly to the busy time. The same seconds, the generations and their
tokens go to the process's Prometheus counters as they are stored (generate/metrics.py).

What runs between two engine steps is time the GPU waits (a step at 256 in flight is 10-40 ms on a GPU), so
the step path does no per-request Python it can avoid: the shares are array operations over the batch
(BusyShares); a finished request's output checks run on a thread of their own while the engine steps
(`served`); and finished requests are priced and stored together (`record`: one store's transactions for
many requests, not for each step that finished some).
"""

from __future__ import annotations

import logging
import secrets
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pyarrow as pa

from pipeline.config import SamplingConfig, TokenmillConfig
from pipeline.generate import metrics
from pipeline.generate.engine import STARTUP_SECONDS, EnginePool
from pipeline.generate.engine_api import Completion, Progressed
from pipeline.generate.followup import record_id
from pipeline.generate.levers import counter_delta, read_counters
from pipeline.generate.pricing import baseline_gpu_seconds, token_weight
from pipeline.generate.quality import complete_sentences, measure
from pipeline.generate.reuse import cache_value
from pipeline.keys import adapter_digest, request_sampling
from pipeline.stores.catalog import now
from pipeline.stores.units import WorkUnit

log = logging.getLogger(__name__)

# How often the session's figures are written while it runs. A worker killed between two writes leaves
# what it measured since the last one unrecorded (at most this long, plus one step, per GPU): the bound on
# engine time no ledger can carry. Measured-but-unstored work before that write is billed as `lost`.
SESSION_BEAT_SECONDS = 2.0

# Finished requests are stored together once this long has passed since the first of them finished, or a batch
# of them (the engine's `max_num_seqs`) is waiting, or a unit has all its requests in, or nothing is in flight.
# A worker killed before the store leaves their engine time unrecorded: billed as `lost`, generated again.
STORE_SECONDS = 1.0

# engine -> when its last session closed (idle since then is the next one's); weak keys, as STARTUP_SECONDS.
_FREE_SINCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def batch_size(engine, configured: int | None) -> int:
    """The most sequences the engine's scheduler runs at once: as configured, else vLLM's own default."""
    scheduler = getattr(
        getattr(getattr(getattr(engine, "llm", None), "llm_engine", None), "vllm_config", None),
        "scheduler_config",
        None,
    )
    return configured or getattr(scheduler, "max_num_seqs", None) or 256


def forget_idle_between_jobs() -> None:
    """Charge the time since engines' last sessions to no job: for benchmarks comparing runs on warm
    engines, where the gap between runs is the benchmark's own set-up, not a job's idle engine."""
    _FREE_SINCE.clear()


@dataclass
class InFlight:
    unit: WorkUnit
    row: dict  # the request row (prompt_token_ids, max_tokens, generation)
    seconds: float = 0.0  # busy wall seconds shared to it (set when it finishes: BusyShares holds them till then)
    checked: Future | None = None  # once finished: (the text served, its output checks' measures), see `served`


def served(c: Completion, generation: dict, sampling: SamplingConfig) -> tuple[str, dict]:
    """The text served of a finished request and what its output checks read (quality.measure): checked once, where
    the output meets the text it summarises. A cut output is served to its last complete sentence (still `length`:
    flagged truncated, every token paid); JSON is left whole for its validation to judge."""
    if generation.get("judge"):  # a verdict, not a summary: its first word is read whole, and checked by nothing
        return c.text, {}
    cut = c.finish_reason == "length" and sampling.json_schema is None
    text = complete_sentences(c.text) if cut else c.text
    return text, measure(text, generation.get("document", generation["text"]))


def tenant_adapter(config: TokenmillConfig, generation: dict, tier: str) -> str | None:
    """The LoRA adapter a generation runs with: its tenant's on this tier; none for the judge, whose verdict is
    the base model's (a tenant's adapter is trained to summarise, not to judge)."""
    return None if generation.get("judge") else config.adapter(generation["tenant"], tier)


class BusyShares:
    """The busy seconds of the requests in flight, shared out step by step: per request a slot in arrays (prompt
    tokens, output tokens weighed so far, seconds), so a step's sharing is a few array operations over the batch
    instead of Python per request."""

    def __init__(self, cost):
        self.cost = cost
        self.slot: dict[str, int] = {}  # request id -> its slot
        self.free: list[int] = []
        self.prompt = np.zeros(0, dtype=np.int64)  # its prompt tokens until its prefill is weighed, then 0
        self.cached = np.zeros(0, dtype=np.int64)  # its cached prompt tokens, once it finished
        self.output = np.zeros(0, dtype=np.int64)  # output tokens weighed so far
        self.seconds = np.zeros(0, dtype=np.float64)
        self.live = np.zeros(0, dtype=bool)

    def add(self, request_id: str, prompt_tokens: int) -> None:
        if not self.free:
            n = len(self.seconds)
            grow = max(n, 64)
            self.prompt, self.cached, self.output, self.seconds, self.live = (
                np.concatenate([a, np.zeros(grow, dtype=a.dtype)])
                for a in (self.prompt, self.cached, self.output, self.seconds, self.live)
            )
            self.free.extend(range(n + grow - 1, n - 1, -1))
        i = self.slot[request_id] = self.free.pop()
        self.prompt[i], self.cached[i], self.output[i], self.seconds[i], self.live[i] = prompt_tokens, 0, 0, 0.0, True

    def pop(self, request_id: str) -> float:
        """The request's seconds; its slot is free again."""
        i = self.slot.pop(request_id)
        self.live[i] = False
        self.free.append(i)
        return float(self.seconds[i])

    def share(self, dt: float, progressed: list[Progressed], finished: list[Progressed]) -> None:
        """Share one busy interval among the requests in flight by the token weight of what it advanced: a
        request's uncached prompt the first time it shows, each output token once."""
        slot = self.slot
        for p in finished:  # few a step: their cached prompt tokens, weighed if this is their first showing
            if p.completion is not None and p.request_id in slot:
                self.cached[slot[p.request_id]] = p.completion.cached_prompt_tokens
        n = len(progressed)
        at = np.fromiter((slot.get(p.request_id, -1) for p in progressed), dtype=np.int64, count=n)
        tokens = np.fromiter((p.output_tokens for p in progressed), dtype=np.int64, count=n)
        if n and at.min() < 0:  # a request not in flight here (already given up on): nothing to share to it
            tokens, at = tokens[at >= 0], at[at >= 0]
        prompt = self.prompt[at]
        weights = token_weight(prompt, np.where(prompt > 0, self.cached[at], 0), tokens - self.output[at], self.cost)
        self.prompt[at], self.output[at] = 0, tokens
        total = weights.sum()
        if total <= 0:  # nothing visible advanced (a prefill in progress): share evenly
            if slot:
                self.seconds[self.live] += dt / len(slot)
            return
        self.seconds[at] += dt * (weights / total)


@dataclass
class Failure:
    """A request given up on: why, and the engine time it took (a failed attempt's charge)."""

    reason: str
    detail: str
    unit: WorkUnit
    generation: dict
    gpu_seconds: float = 0.0


@dataclass
class WorkerReport:
    tier: str
    session_id: str | None = None
    units: int = 0
    requests: int = 0
    started: bool = False
    startup_seconds: float = 0.0
    busy_seconds: float = 0.0
    idle_seconds: float = 0.0

    @property
    def held_seconds(self) -> float:
        return self.startup_seconds + self.busy_seconds + self.idle_seconds


class UnitSource(Protocol):
    """Where a tier worker claims its units: the catalog's queue (stores/units.UnitQueue) for a job, or
    memory for a run with no job (generate/memory_units.py)."""

    def claim(self, job_id: str, tier: str, worker: str, session_id: str, lease_seconds: float) -> WorkUnit | None: ...

    def claimable(self, job_id: str, tier: str | None = None) -> int: ...

    def finish(self, job_id: str, unit: WorkUnit, status: str = "done") -> bool: ...

    def renew(self, job_id: str, session_id: str, lease_seconds: float) -> None: ...

    def open_session(
        self,
        session_id: str,
        job_id: str,
        tier: str,
        worker: str,
        gpus: int,
        started: bool,
        startup_seconds: float,
        idle_seconds: float,
        lease_seconds: float,
    ) -> None: ...

    def beat_session(
        self,
        session_id: str,
        busy: float,
        idle: float,
        recorded: float,
        closed: bool = False,
        counters: dict[str, int | None] | None = None,
        *,
        lease_seconds: float,
    ) -> None: ...


class JobSide(Protocol):
    """What a tier worker needs from the job it drains, for its tier (the job's drain step implements it)."""

    cache_status: str  # recorded on every item: off | bypassed | miss

    def requests(self, unit: WorkUnit) -> list[dict]:
        """The unit's requests still to run (prompt_token_ids, max_tokens, generation)."""

    def unit_done(self, unit: WorkUnit) -> None:
        """Every request of the unit is in: derive the next waves it lets go on (its partition's, and those of
        partitions waiting on its keys)."""

    def unit_failed(self, unit: WorkUnit, error: str) -> None:
        """The unit cannot run (its requests unreadable): its partition fails, the others go on."""

    def more_may_come(self) -> bool:
        """Whether units of this tier can still arrive (escalations from the other tiers' units): a question,
        which changes nothing."""

    def admit(self, unit: WorkUnit, rows: list[dict]) -> bool:
        """Budget admission of one unit's requests (reserved under its claim); False defers the unit."""

    def store(self, items: dict[str, dict], failed: dict[str, Failure]) -> None:
        """Keep what finished: items by key (paid, priced) and the requests given up on."""

    def cache_put(self, by_scope: dict[str, dict]) -> None:
        """Offer the new items to the reuse cache, by dedup scope."""


@dataclass
class TierWorker:
    """Drains one tier's units of one job; `job` supplies what needs the job (JobSide)."""

    config: TokenmillConfig
    tier: str
    job_id: str
    queue: UnitSource
    pool: EnginePool
    worker: str
    job: JobSide
    release: bool = False  # shut the engine down at the end (its process will not reuse it)
    flight: dict[str, InFlight] = field(default_factory=dict)
    remaining: dict[str, int] = field(default_factory=dict)  # unit id -> requests not finished
    unstored: list[tuple[Progressed, InFlight]] = field(default_factory=list)  # finished, to store (`record`)
    complete: list[WorkUnit] = field(default_factory=list)  # units whose last request is among them
    recorded: float = 0.0
    session_id: str = ""
    report: WorkerReport | None = None
    meter: metrics.EngineMeter | None = None

    def drain(self) -> WorkerReport:
        self.report = report = WorkerReport(self.tier)
        # The engine starts only once there is a unit to run: a tier waiting for escalations holds no GPU.
        while True:
            # Asked first, then the queue: a feeder finishes its unit only after enqueueing what it escalates, so
            # once none is seen unfinished, every unit it will ever send is claimable by then. The other order
            # loses a unit enqueued between the two questions (the feeder done, this tier's queue seen empty).
            more = self.job.more_may_come()
            if self.claimable():
                break
            if not more:
                return report  # nothing for this tier: no engine start, no session
            time.sleep(self.config.state.wait_seconds)
        engine = self.open_session()
        counted = read_counters(engine)  # counters: this engine session's share, at its close
        self.loop(engine)
        self.close_session(engine, counter_delta(counted, read_counters(engine)))
        log.info(
            "tier %s worker %s: %d units, %d requests; engine held %.1f s (start-up %.1f, busy %.1f, idle %.1f)",
            self.tier,
            self.worker,
            report.units,
            report.requests,
            report.held_seconds,
            report.startup_seconds,
            report.busy_seconds,
            report.idle_seconds,
        )
        return report

    def open_session(self):
        """The tier's engine (started here unless this process runs it already), in a new engine session."""
        report, tier = self.report, self.config.tiers[self.tier]
        engine = self.pool.running(self.tier)
        if engine is None:
            engine = self.pool.engine(self.tier)
            report.started = True
        report.startup_seconds = STARTUP_SECONDS.pop(engine, 0.0)
        report.idle_seconds = time.perf_counter() - _FREE_SINCE.pop(engine) if engine in _FREE_SINCE else 0.0
        self.batch = batch_size(engine, tier.vllm.max_num_seqs)
        report.session_id = self.session_id = f"{self.worker}/{self.tier}/{secrets.token_hex(4)}"
        self.meter = metrics.EngineMeter(self.tier)
        self.meter.watch(engine)
        self.publish()
        self.queue.open_session(
            self.session_id,
            self.job_id,
            self.tier,
            self.worker,
            tier.gpus,
            report.started,
            report.startup_seconds,
            report.idle_seconds,
            self.config.state.lease_seconds,
        )
        return engine

    def loop(self, steps) -> None:
        """The loop: claim units while the batch has room, step the engine, share its seconds, record what
        finished, renew. A step with work in flight asks the queue for more only every `wait_seconds` once it
        found none (a query each step would cost more than the step); with none in flight, at once."""
        report, sid, gpus = self.report, self.session_id, self.config.tiers[self.tier].gpus
        lease, poll = self.config.state.lease_seconds, self.config.state.wait_seconds
        mark = renewed = beaten = time.perf_counter()
        ask_after = unstored_since = 0.0
        self.shares = BusyShares(self.config.cost)
        # The output checks of finished requests run on a thread of their own while the engine steps: a real
        # engine's step waits on its engine process (the GIL free), a GPU's step is 10-40 ms of such waiting.
        self.checks = ThreadPoolExecutor(1, thread_name_prefix=f"checks-{self.tier}")
        try:
            while True:
                if not self.flight or mark >= ask_after:
                    while len(self.flight) < self.fill():
                        unit = self.claim(sid)
                        if unit is None:
                            ask_after = mark + poll
                            break
                        self.start(unit, steps, sid, report)
                busy = bool(self.flight)
                progressed = steps.step() if busy else []
                if not busy:
                    if not self.job.more_may_come() and not self.claimable():
                        return
                    time.sleep(poll)
                t = time.perf_counter()
                dt, mark = t - mark, t
                if busy:
                    report.busy_seconds += dt
                    finished = [p for p in progressed if p.completion is not None or p.error]
                    self.shares.share(dt, progressed, finished)
                    if not self.unstored:
                        unstored_since = t
                    self.finish(finished)
                else:
                    report.idle_seconds += dt
                if self.unstored and (
                    self.complete
                    or not self.flight
                    or len(self.unstored) >= self.batch
                    or t - unstored_since >= STORE_SECONDS
                ):
                    self.record(gpus)
                if t - renewed > lease / 3:
                    renewed = t
                    self.queue.renew(self.job_id, sid, lease)
                if t - beaten > SESSION_BEAT_SECONDS:
                    beaten = t
                    self.queue.beat_session(
                        sid, report.busy_seconds, report.idle_seconds, self.recorded, lease_seconds=lease
                    )
                    self.publish(depth=True)
        except Exception:
            # What finished before the failure (an engine that died, a store refused) is paid for: kept if it can be.
            unstored = len(self.unstored)
            if unstored:
                try:
                    self.record(gpus)
                except Exception as e:
                    log.warning("tier %s: %d finished requests not stored: %s", self.tier, unstored, e)
            raise
        finally:
            self.checks.shutdown(cancel_futures=True)

    def close_session(self, engine, counted: dict) -> None:
        """Shut the engine down (`release`) or keep it for the next engine session; close this one."""
        report = self.report
        if self.release:
            t = time.perf_counter()
            self.pool.shutdown(self.tier)
            report.idle_seconds += time.perf_counter() - t  # held until its memory is free again
        else:
            _FREE_SINCE[engine] = time.perf_counter()
        self.queue.beat_session(
            self.session_id,
            report.busy_seconds,
            report.idle_seconds,
            self.recorded,
            closed=True,
            counters=counted,
            lease_seconds=self.config.state.lease_seconds,
        )
        self.publish(depth=True)
        self.meter.unwatch()

    def publish(self, depth: bool = False) -> None:
        """The session's seconds so far to the metrics (and, with `depth`, the tier's claimable units: a query, made
        only when something reads the metrics)."""
        r = self.report
        self.meter.publish(r.startup_seconds, r.busy_seconds, r.idle_seconds)
        if depth and metrics.wanted(self.config.metrics):
            metrics.queue_depth(self.tier, self.queue.claimable(self.job_id, self.tier))

    def fill(self) -> int:
        # Twice the scheduler's batch: as requests finish, the next ones are already waiting in vLLM. Under
        # a budget cap, one unit at a time: each is admitted knowing what the ones before it cost.
        return 1 if self.config.budget.active else 2 * self.batch

    def claim(self, sid: str) -> WorkUnit | None:
        return self.queue.claim(self.job_id, self.tier, self.worker, sid, self.config.state.lease_seconds)

    def claimable(self) -> bool:
        # Units other live workers hold are theirs: should one die, its units are claimable once its lease
        # ends, by whichever worker of the tier runs then (a retried task, a rerun, a waiting commit).
        return self.queue.claimable(self.job_id, self.tier) > 0

    def start(self, unit: WorkUnit, steps, sid: str, report: WorkerReport) -> None:
        try:
            rows = self.job.requests(unit)
        except Exception as e:  # e.g. its staged requests unreadable: that partition fails, the others go on
            self.job.unit_failed(unit, f"{type(e).__name__}: {e}")
            self.queue.finish(self.job_id, unit)
            return
        if rows and not self.job.admit(unit, rows):
            self.queue.finish(self.job_id, unit, "deferred")
            metrics.deferred(self.tier)
            log.warning("tier %s: unit %s deferred at a budget cap", self.tier, unit.unit_id)
            return
        report.units += 1
        report.requests += len(rows)
        failed = {}
        self.remaining[unit.unit_id] = 0
        for i, row in enumerate(rows):
            rid = f"{unit.unit_id}\x00{i}"
            try:
                adapter = tenant_adapter(self.config, row["generation"], self.tier)
                steps.add(
                    rid,
                    row["prompt_token_ids"],
                    row["max_tokens"],
                    request_sampling(self.config.sampling, row["generation"].get("request")),
                    **({"adapter": adapter} if adapter else {}),
                )
            except Exception as e:  # vLLM refuses a bad request when it is added; the others go on
                failed[row["generation"]["item_key"]] = Failure(
                    "engine_error", f"{type(e).__name__}: {e}"[:500], unit, row["generation"]
                )
                continue
            self.flight[rid] = InFlight(unit, row)
            self.shares.add(rid, len(row["prompt_token_ids"]))
            self.remaining[unit.unit_id] += 1
        if failed:
            self.job.store({}, failed)
        if not self.remaining[unit.unit_id]:
            self.done(unit)

    def finish(self, finished: list[Progressed]) -> None:
        """Take the requests that finished in a step out of flight, with their seconds, to be recorded."""
        for p in finished:
            f = self.flight.pop(p.request_id, None)
            if f is None:
                continue
            f.seconds = self.shares.pop(p.request_id)
            if p.completion is not None:
                f.checked = self.checks.submit(served, p.completion, f.row["generation"], self.config.sampling)
            self.unstored.append((p, f))
            self.remaining[f.unit.unit_id] -= 1
            if self.remaining[f.unit.unit_id] == 0:
                self.complete.append(f.unit)

    def record(self, gpus: int) -> None:
        """Price, check and store the finished requests not stored yet, together; finish the units they complete."""
        done, complete, self.unstored, self.complete = self.unstored, self.complete, [], []
        items, failed, by_scope, digests, created = {}, {}, {}, {}, now()
        ok, unchecked = [], []  # (progressed, in flight, (text, measures)); (in flight, why its checks failed)
        for p, f in done:
            if p.completion is not None:
                try:  # one output the checks cannot measure is that item's failure, not the batch's
                    ok.append((p, f, f.checked.result()))
                except Exception as e:
                    unchecked.append((f, f"output checks failed: {type(e).__name__}: {e}"))
        gpu = np.array([f.seconds * gpus for _, f, _ in ok])
        base = (
            baseline_gpu_seconds(
                pa.table(
                    {
                        "tier": [self.tier] * len(ok),
                        "prompt_tokens": [p.completion.prompt_tokens for p, _, _ in ok],
                        "cached_prompt_tokens": [p.completion.cached_prompt_tokens for p, _, _ in ok],
                        "output_tokens": [p.completion.output_tokens for p, _, _ in ok],
                    }
                ),
                gpu,
                self.config.largest_tier,
                self.config.cost,
            )
            if ok
            else []
        )
        model, price = self.config.tiers[self.tier].generator, self.config.tiers[self.tier].price_per_gpu_hour
        for (p, f, (text, measures)), g, b in zip(ok, gpu, base):
            gen, c = f.row["generation"], p.completion
            key = gen["item_key"]
            adapter = tenant_adapter(self.config, gen, self.tier)
            if adapter not in digests:  # read once per store: the adapter the engine serves now
                digests[adapter] = adapter_digest(adapter)
            items[key] = {
                "tier": self.tier,
                "model": model,
                "adapter_digest": digests[adapter],
                "summary": text,
                "prompt_tokens": c.prompt_tokens,
                "cached_prompt_tokens": c.cached_prompt_tokens,
                "output_tokens": c.output_tokens,
                "finish_reason": c.finish_reason,
                "mean_logprob": c.mean_logprob,
                "id": record_id(gen),
                "tenant": gen["tenant"],
                "partition": f.unit.partition,
                "gpu_seconds": float(g),
                "baseline_gpu_seconds": float(b),
                "created_at": created,
                "cache_status": self.job.cache_status,
                "session_id": f.unit.session_id,
                **measures,
                **({"chunks": gen["chunks"]} if gen.get("chunks") else {}),
            }
            by_scope.setdefault(gen["scope"], {})[key] = cache_value(items[key], self.job_id, float(g) * price / 3600)
        for p, f in done:
            if p.completion is None:  # failed even alone: its share of the engine's time is a failed attempt
                failed[f.row["generation"]["item_key"]] = Failure(
                    "engine_error", p.error, f.unit, f.row["generation"], f.seconds * gpus
                )
        for f, why in unchecked:
            failed[f.row["generation"]["item_key"]] = Failure(
                "engine_error", why, f.unit, f.row["generation"], f.seconds * gpus
            )
        self.recorded += sum(f.seconds for _, f in done)
        # Renewed before every store, so that a worker killed at any point leaves figures that add up: what it
        # measured but did not store is lost work, never more than it held (pricing.session_shares).
        self.queue.beat_session(
            self.session_id,
            self.report.busy_seconds,
            self.report.idle_seconds,
            self.recorded,
            lease_seconds=self.config.state.lease_seconds,
        )
        self.job.store(items, failed)
        metrics.generated(self.tier, items.values(), price)
        self.publish()
        self.job.cache_put(by_scope)
        for unit in complete:
            self.done(unit)

    def done(self, unit: WorkUnit) -> None:
        del self.remaining[unit.unit_id]
        # The next wave first, then the unit: a worker of the tier it feeds that sees no unfinished unit here
        # has seen that wave enqueued.
        self.job.unit_done(unit)
        if not self.queue.finish(self.job_id, unit):
            log.warning(
                "tier %s: unit %s was taken over by another worker; its items are stored, not committed here",
                self.tier,
                unit.unit_id,
            )
            return
        # Once more now that the unit is closed: a partition waiting on another unit's keys is advanced by that
        # unit's worker only if it has no open unit then; this one was open a moment ago, so that worker may have
        # passed it over while its keys were already in (an idempotent advance: a wave is derived once).
        self.job.unit_done(unit)
