"""What the engine tests share: running requests through an engine's streaming interface to the end."""


def drain(engine, requests, sampling):
    """Add every (request id, prompt ids, max_tokens[, adapter]) at once, step until all finish.

    Returns every Progressed the steps reported, in order, and the completions by request id."""
    for rid, prompt, max_tokens, *adapter in requests:
        engine.add(rid, prompt, max_tokens, sampling, **({"adapter": adapter[0]} if adapter and adapter[0] else {}))
    seen, done = [], {}
    while len(done) < len(requests):
        for p in engine.step():
            seen.append(p)
            if p.completion is not None:
                done[p.request_id] = p.completion
    return seen, done


class OneCallEngine:
    """The streaming interface (`add`/`step`) for test doubles that only define `generate`, each on purpose
    (an engine that fails on one prompt, a slow one): each step runs everything added since the last as one
    call. A call that raises is run again as two halves, down to single prompts, so that one failing prompt
    fails alone (its Progressed carries the error) and the others finish."""

    def add(self, request_id, prompt, max_tokens, sampling, adapter=None) -> None:
        if adapter is not None:
            raise ValueError(f"this engine serves no LoRA adapters (asked for {adapter})")
        self.__dict__.setdefault("queued", []).append((request_id, prompt, max_tokens, sampling))

    def step(self):
        from pipeline.generate.engine_api import Progressed

        queued, self.queued = self.__dict__.get("queued", []), []
        if not queued:
            return []
        results = self._halving([q[1] for q in queued], [q[2] for q in queued], queued[0][3])
        return [
            Progressed(q[0], r.output_tokens, r) if not isinstance(r, str) else Progressed(q[0], 0, None, r)
            for q, r in zip(queued, results)
        ]

    def _halving(self, prompts, max_tokens, sampling):
        from pipeline.generate.engine_api import EngineDeadError

        try:
            return list(self.generate(prompts, max_tokens, sampling))
        except EngineDeadError:
            raise
        except Exception as e:
            if len(prompts) == 1:
                return [f"{type(e).__name__}: {e}"[:500]]
            mid = len(prompts) // 2
            return self._halving(prompts[:mid], max_tokens[:mid], sampling) + self._halving(
                prompts[mid:], max_tokens[mid:], sampling
            )
