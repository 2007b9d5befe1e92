"""agent: one per host per job; acts on placement (docs/operations/agent.md). Not a job role."""
