"""The runtime drop-in that lets one `rlfleet@` unit run the sandbox (docs/operations/sandbox.md).

The template unit gives every daemon no capabilities, no namespaces and no privileged
system calls. A daemon whose role runs untrusted code (common/seams.sandboxed_roles:
the env-host of a tool-use task, the reward-host of a `user_code` reward) needs a few
of them back for common/sandbox/parent.py's child, which confines itself and then drops them
all before the code runs. The systemd backend writes this drop-in for such a unit only,
just before it starts it, and removes it when it stops it:

    /run/systemd/system/rlfleet@<job>:<id>.service.d/50-sandbox.conf

In /run, so a reboot forgets it with the unit's environment file (the agent writes both
again before it starts anything). Every other unit keeps the template's hardening.
"""

from __future__ import annotations

import os
from pathlib import Path

DROPIN_DIR = Path("/run/systemd/system")  # systemd's runtime unit directory (a path, not a key)
DROPIN_NAME = "50-sandbox.conf"

# Each line adds to the template's setting (systemd merges these lists) or overrides it.
DROPIN_TEXT = """\
# Written by the rlfleet agent (daemons/agent/sandbox_dropin.py) because this daemon's role
# runs untrusted code in the sandbox; removed when the agent stops the unit. docs/operations/sandbox.md
[Service]
# The sandbox's child needs these to confine itself: CAP_SYS_ADMIN for its namespaces and
# mounts, CAP_SETUID/CAP_SETGID to become the run's own uid, CAP_KILL for the parent to
# sweep that uid's processes. The child clears every capability set before the code runs.
CapabilityBoundingSet=CAP_SYS_ADMIN CAP_SETUID CAP_SETGID CAP_KILL
AmbientCapabilities=CAP_SYS_ADMIN CAP_SETUID CAP_SETGID CAP_KILL
# unshare(CLONE_NEWNS | CLONE_NEWNET): no user, pid, ipc, uts or cgroup namespace.
RestrictNamespaces=mnt net
# Back into the allow-list (@system-service less @privileged): the child's own calls.
SystemCallFilter=mount setgroups setresuid capset
# The parent finds the run's leftover processes (another uid) in /proc; "invisible" hides them.
ProtectProc=default
# The uid pool's lock files, shared by every sandboxing unit of the host: kept when one
# stops, since another may hold a lock in it.
RuntimeDirectory=rlfleet-sandbox
RuntimeDirectoryMode=0711
RuntimeDirectoryPreserve=yes
"""


class SandboxDropins:
    """Writes and removes the drop-in of each unit; `directory` is injectable for tests."""

    def __init__(self, directory: Path = DROPIN_DIR) -> None:
        self.directory = directory

    def path(self, unit: str) -> Path:
        return self.directory / f"{unit}.d" / DROPIN_NAME

    def apply(self, unit: str, wanted: bool) -> bool:
        """Make the drop-in of `unit` present or absent; True when that changed a file
        (systemd reads it only after a daemon-reload)."""
        path = self.path(unit)
        if not wanted:
            try:
                path.unlink()
            except FileNotFoundError:
                return False
            try:
                path.parent.rmdir()
            except OSError:
                pass  # other drop-ins live there too
            return True
        try:
            if path.read_text() == DROPIN_TEXT:
                return False
        except FileNotFoundError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(DROPIN_TEXT)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # a daemon-reload never reads half of it
        return True
