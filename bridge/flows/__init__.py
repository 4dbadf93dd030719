"""The bridge's flows: one item in, one outcome out. `verify` (a `/verify` item) and `run` (a
`/run` rollout) build their bodies and read their replies; what they share: the item checks
(`checks`, `run_checks`), the routing table (`upstreams`), the replicas and their slots
(`balancer`), the attempts and the deadline cut (`attempts`)."""
