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
