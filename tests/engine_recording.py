"""What an engine's runner sees in its first step: the prefill's features and every drafter call."""


def first_step_seen(engine, condition) -> dict:
    """Run one request's first step on `engine`, recording the runner's prefill features ("features") and each
    drafter call's inputs and logits ("drafts")."""
    from lantern.engine import Request

    runner, seen = engine.runner, {"drafts": []}
    prefill, draft = runner.prefill, runner.draft

    def record_prefill(cond, mask):
        out = prefill(cond, mask)
        seen["features"] = out.hidden.clone()
        return out

    def record_draft(*inputs):
        out = draft(*inputs)
        seen["drafts"].append(([x.clone() for x in inputs], out.logits.clone()))
        return out

    runner.prefill, runner.draft = record_prefill, record_draft
    engine.submit(Request(condition, seed=0))
    engine.step()
    return seen
