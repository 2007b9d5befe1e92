"""rlfleet.relay: the weight plane — shared-memory weight store, chunk protocol, transports, chain topology.

Entry points: `publisher.WeightPublisher` (trainer), `reader.WeightReader` (rollouts),
`node.RelayNode` (a relay's data plane, run by daemons/relay), `status.chain_status` (operators).
See docs/design/relay.md.
"""
