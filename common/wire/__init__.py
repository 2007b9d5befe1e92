"""The data plane's messages and sockets: wire messages and arrays, their validation,
ZeroMQ sockets, reliable delivery, the async client, outboxes, CURVE and its edges."""
