"""`rlfleet run` on one machine: the supervisor (the embedded fleet), its private etcd, the run's
layout and credentials, the one-owner-per-job check, the live summary and the end report."""
