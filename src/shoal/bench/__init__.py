"""`shoal bench`: a load generator for any OpenAI-compatible server.

Pure parts (usable without a server, e.g. by a simulator): `lengths`, `text`, `arrivals`,
`workloads` (what to send and when) and `stats` (what the records say). Live parts: `client`
(one streamed chat completion), `runner` (a workload against a server), `report` and `plots`
(tables, JSON and PNGs), `options` and `command` (the CLI).
"""
