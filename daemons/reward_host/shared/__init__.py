"""The shared reward service (`rlfleet reward-service`): several jobs' reward-hosts on one
pipeline; its spec, request reading, answers journal and HTTP(S) server."""
