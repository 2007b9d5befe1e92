"""env-host: EnvManagers (one asyncio task per trajectory), the partial-trajectory journal, prompt claims."""
