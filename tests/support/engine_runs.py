"""Running an engine's requests to completion, checking its invariants every step."""

from __future__ import annotations


def run_to_completion(engine, requests: dict[str, tuple]) -> dict[str, list[int]]:
    """Adds (prompt, params) per request id, steps until done, checks invariants every step."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        engine.check_integrity()
    return results
