"""The operator's commands against a live job in etcd: status (fleet_view), node, pause and resume,
switchover, etcd maintenance, CURVE keys, the shared reward service, the accounting check,
and the --etcd options they share."""
