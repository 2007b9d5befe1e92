"""`build`: the controller's packages and the cached base rootfs every lab host boots from.

The base is a Debian minbase (debootstrap) with everything the hosts need baked in,
since the hosts reach no registry. It is built in rootfs.tmp and renamed into place,
then a stamp records what it holds: a later `build` with the same package list,
disabled units and key is a no-op, and a changed list rebuilds it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from rlfleet.tools.lab.commands import CommandFailed, run, run_long, say
from rlfleet.tools.lab.paths import (
    BASE_DISABLED_UNITS,
    BASE_PACKAGES,
    CACHE,
    CONTROLLER_PACKAGES,
    KEY,
    ROOTFS,
    ROOTFS_STAMP,
    SUITE,
)

RECIPE = 1  # bump when the steps below change what ends up in the base
# debootstrap's own resolver handles plain Depends only; apt (in the chroot) installs the rest.
DEBOOTSTRAP_INCLUDE = ("systemd", "systemd-sysv", "dbus")
SSHD_DROPIN = "PasswordAuthentication no\nPermitRootLogin prohibit-password\nUseDNS no\n"


def ensure_controller_packages() -> None:
    """apt-get install what the controller needs, only when something is missing."""
    missing = [p for p in CONTROLLER_PACKAGES
               if run(["dpkg-query", "-W", "-f=${Status}", p], check=False).stdout.strip() != "install ok installed"]
    if not missing:
        say(f"controller packages present: {' '.join(CONTROLLER_PACKAGES)}")
        return
    say(f"apt-get install {' '.join(missing)}")
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    run(["apt-get", "update", "-qq"], timeout=600, env=env)
    run(["apt-get", "install", "-y", "-qq", *missing], timeout=900, env=env)


def ensure_key() -> str:
    """The lab's SSH key (baked into the base, so shared by every lab); returns the public key."""
    if not KEY.exists():
        KEY.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rlfleet-lab", "-f", str(KEY)])
    return KEY.with_suffix(".pub").read_text().strip()


def apt_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 .sources or a one-line sources.list)."""
    for src in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in src.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
            if SUITE in fields.get("Suites", "").split() and "deb" in fields.get("Types", "").split():
                return fields["URIs"].split()[0]
    for lst in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*.list"))]:
        if lst.exists():
            m = re.search(rf"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+{SUITE}\s", lst.read_text(), re.M)
            if m:
                return m.group(1)
    raise CommandFailed(f"no apt source for {SUITE} found in /etc/apt: pass --mirror")


def wanted_stamp(pubkey: str) -> dict:
    return {"recipe": RECIPE, "suite": SUITE, "packages": sorted(BASE_PACKAGES),
            "disabled": sorted(BASE_DISABLED_UNITS), "authorized_key": pubkey}


def cached(pubkey: str) -> dict | None:
    """The stamp of a complete base holding what we want, else None."""
    try:
        stamp = json.loads(ROOTFS_STAMP.read_text())
    except (OSError, ValueError):
        return None
    if not (ROOTFS / "usr/lib/os-release").exists():
        return None
    return stamp if {k: stamp.get(k) for k in wanted_stamp(pubkey)} == wanted_stamp(pubkey) else None


def in_use() -> list[str]:
    """Overlay mounts that use the base as their lower layer (hosts of a lab that is up)."""
    return [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
            if line.startswith("overlay ") and f"lowerdir={ROOTFS}," in line]


def build(mirror: str | None = None, force: bool = False) -> dict:
    """Make sure the controller packages and a complete, current base exist; returns the stamp."""
    t0 = time.monotonic()
    ensure_controller_packages()
    pubkey = ensure_key()
    stamp = cached(pubkey)
    if stamp and not force:
        say(f"base rootfs cached at {ROOTFS} (built {stamp['built_at']}, {stamp['build_s']:.0f} s); "
            f"checked in {time.monotonic() - t0:.1f} s")
        return stamp
    if in_use():
        raise CommandFailed(f"the base is in use by {in_use()}: run `down` on those labs before rebuilding it")
    mirror = mirror or apt_mirror()
    tmp = CACHE / "rootfs.tmp"
    _remove(tmp)
    log = CACHE / "build.log"
    log.unlink(missing_ok=True)
    say(f"debootstrap {SUITE} minbase from {mirror} into {tmp} (a few minutes; log {log})")
    run_long(["debootstrap", "--variant=minbase", f"--include={','.join(DEBOOTSTRAP_INCLUDE)}", SUITE, str(tmp),
              mirror], "debootstrap", log)
    _install_packages(tmp, log)
    _make_generic(tmp, pubkey)
    _remove(ROOTFS)
    tmp.rename(ROOTFS)
    took = time.monotonic() - t0
    stamp = {**wanted_stamp(pubkey), "mirror": mirror, "build_s": round(took, 1),
             "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "size_mb": round(_du_mb(ROOTFS))}
    ROOTFS_STAMP.write_text(json.dumps(stamp, indent=1) + "\n")
    say(f"base rootfs built in {took:.0f} s ({stamp['size_mb']} MB) at {ROOTFS}")
    return stamp


def _install_packages(root: Path, log: Path) -> None:
    """apt-get install the base packages inside the chroot, with no service started."""
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")  # invoke-rc.d: starting services is not allowed here
    policy.chmod(0o755)
    run(["mount", "-t", "proc", "proc", str(root / "proc")])
    try:
        env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
        run_long(["chroot", str(root), "apt-get", "update"], "apt-get update (chroot)", log, env=env)
        run_long(["chroot", str(root), "apt-get", "install", "-y", "--no-install-recommends", *BASE_PACKAGES],
                 "apt-get install (chroot)", log, env=env)
        run(["chroot", str(root), "apt-get", "clean"], env=env)
    finally:
        run(["umount", str(root / "proc")], check=False)
        policy.unlink(missing_ok=True)


def _make_generic(root: Path, pubkey: str) -> None:
    """What makes the base a template rather than a machine: no identity of its own."""
    # An empty machine-id: systemd fills it at first boot; `up` writes one per host before that.
    (root / "etc/machine-id").write_text("")
    dbus_id = root / "var/lib/dbus/machine-id"
    dbus_id.unlink(missing_ok=True)
    dbus_id.parent.mkdir(parents=True, exist_ok=True)
    dbus_id.symlink_to("/etc/machine-id")
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()  # per host, made by `up`; else every host shares one host key
    (root / "etc/hostname").unlink(missing_ok=True)
    (root / "etc/ssh/sshd_config.d").mkdir(exist_ok=True)
    (root / "etc/ssh/sshd_config.d/rlfleet-lab.conf").write_text(SSHD_DROPIN)
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(pubkey + "\n")
    (ssh_dir / "authorized_keys").chmod(0o600)
    for unit in BASE_DISABLED_UNITS:
        # One at a time: a unit some package did not ship is not an error.
        run(["chroot", str(root), "systemctl", "disable", unit], check=False)
    still = [u for u in BASE_DISABLED_UNITS
             if run(["chroot", str(root), "systemctl", "is-enabled", u], check=False).stdout.strip() == "enabled"]
    if still:
        raise CommandFailed(f"units still enabled in the base: {still}")


def _remove(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def _du_mb(path: Path) -> float:
    out = subprocess.run(["du", "-sxm", str(path)], capture_output=True, text=True).stdout.split()
    return float(out[0]) if out else 0.0
