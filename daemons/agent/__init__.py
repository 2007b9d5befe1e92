"""agent: one per host per job; acts on placement (docs/agent.md). Not a job role."""
