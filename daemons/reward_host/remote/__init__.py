"""The `remote_http` reward backend: its spec table, its decisions (no I/O) and its HTTP client."""
