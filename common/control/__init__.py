"""The control plane in etcd: the store and its etcd client, key names, typed records,
members and sessions (leases, elections), operations, pause, switchover, snapshots."""
