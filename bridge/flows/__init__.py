"""The bridge's flows: one item in, one outcome out. `verify` (a `/verify` item) and `run` (a
`/run` rollout) check their items (`verify_checks`, `run_checks`), build their bodies, drive
their attempts and read their replies; what they share: the rules every item passes
(`checks`), the routing table (`upstreams`, read from the head server by `discovery`), the one
upstream call path (`upstream`: the POST, the reply read) over the replicas and their slots
(`balancer`, with `limits` for an adaptive limit) and the retry policy and deadline cut
(`attempts`)."""
