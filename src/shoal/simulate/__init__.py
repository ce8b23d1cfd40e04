"""`shoal simulate`: a discrete-event simulation of a fleet of workers behind the router.

The router side is the router's own code: `route_request` turns each request body into a
RouteRequest, and the real `Balancer` (eligibility, policy, prefix index, in-flight accounting)
places it over real `WorkerState` records fed with simulated load reports. Each worker runs the
engine's own `Scheduler` and `BlockManager` (continuous batching, chunked prefill, paged KV cache
with prefix caching, preemption by recompute); only the forward pass is replaced by a step-cost
model calibrated from a real worker. Workloads are `shoal bench`'s generators.

Modules: `events` (the clock), `cost_model` and `calibration` (how long a step takes), `fleet`
(which workers), `host` (CPU sharing), `tokens` (requests as token ids), `worker`, `membership`
(the router's, with cached views) and `router`, `failures`, `clients` (arrivals, turns,
concurrency), `metrics`, `simulation` (one run), `report` and `plots` (outputs), `options` and
`command` (the CLI). None of them imports torch.
"""
