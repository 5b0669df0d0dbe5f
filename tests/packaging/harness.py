"""Machinery for the packaging tests: build the packages, a cached minimal Debian root file
system, chroots made from it, and systemd-nspawn containers booting it.

Everything runs as root on this machine (mmdebstrap, chroot, rpm --root and systemd-nspawn
need it). Chroots and containers share the host's network namespace, so a daemon inside them
reaches a tansu broker on the host's 127.0.0.1 and the host reaches the daemon's HTTP port.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGING = REPO_ROOT / "packaging"
SUITE = "bookworm"
# What the root file system holds besides the essential set: systemd, to boot it and run
# systemd-analyze/sysusers/tmpfiles, and python3, the package's dependency (so installing the
# .deb needs no download).
ROOTFS_PACKAGES = ("systemd", "python3")
CACHE_DIR = Path(os.environ.get("FERRY_TEST_CACHE", Path.home() / ".cache" / "ferry-tests"))
# Inside chroots and containers: a clean environment, not the test runner's.
CLEAN_ENV = ("env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "HOME=/root")


def run(argv: Sequence[str | Path], *, timeout: float = 300, check: bool = True,
        input: bytes | None = None, env: dict[str, str] | None = None,
        ) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing text output; a failure shows the command and its output."""
    result = subprocess.run(
        [str(a) for a in argv], input=input.decode() if input is not None else None,
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"command failed ({result.returncode}): {' '.join(map(str, argv))}\n"
            f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
        )
    return result


def install_test_deps() -> None:
    """mmdebstrap, rpm, systemd-nspawn, python3-venv, lintian, rpmlint and promtool:
    installed when missing (packaging/install-test-deps.sh says how). One installer at a
    time (``prepare`` may be running): apt refuses a second one."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / ".deps-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run([PACKAGING / "install-test-deps.sh"], timeout=600)


def prepare() -> Path:
    """What the packaging tests need before their first test: the Debian packages they use,
    what a build downloads (``build.sh --fetch-only``: nfpm and the locked wheels, into the
    build's cache) and the root file system; two minutes or more on a fresh machine, mostly
    downloads. ``dev/test`` runs it in the background as the suite begins; the tests then
    find it all ready, or wait for it (the packages and the root file system are locked)."""
    install_test_deps()
    run([PACKAGING / "build.sh", "--fetch-only"], timeout=600)
    return rootfs()


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Packages:
    version: str
    deb: Path
    rpm: Path


def deb_arch() -> str:
    return run(["dpkg", "--print-architecture"]).stdout.strip()


def build_packages() -> Packages:
    """The documented build command, exactly: packaging/build.sh -> dist/."""
    result = run([PACKAGING / "build.sh"], timeout=900)
    written = [Path(line) for line in result.stdout.split()]
    debs = [p for p in written if p.suffix == ".deb"]
    rpms = [p for p in written if p.suffix == ".rpm"]
    assert len(debs) == 1 and len(rpms) == 1, f"build.sh wrote {written}"
    version = re.fullmatch(r"ferry_(.+)_[^_]+\.deb", debs[0].name)
    assert version, debs[0].name
    return Packages(version.group(1), debs[0], rpms[0])


def build_upgrade_deb(version: str, out: Path) -> Path:
    """A later-versioned .deb of the same staged venv: what an upgrade installs."""
    result = run([PACKAGING / "build.sh", "--reuse-stage", "--formats", "deb",
                  "--version", version, "--out", out], timeout=600)
    return Path(result.stdout.split()[-1])


def extract_deb(deb: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    run(["dpkg-deb", "-x", deb, dest])
    return dest


def extract_rpm(rpm: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest.with_suffix(".tgz")
    with rpm.open("rb") as src, archive.open("wb") as out:
        subprocess.run(["rpm2archive", "-"], stdin=src, stdout=out, check=True, timeout=300)
    run(["tar", "-xzf", archive, "-C", dest])
    archive.unlink()
    return dest


def files_containing(root: Path, needle: bytes) -> list[Path]:
    """Regular files under ``root`` whose bytes contain ``needle`` (symlinks: their target)."""
    hits = []
    for path in root.rglob("*"):
        if path.is_symlink():
            if needle in os.readlink(path).encode():
                hits.append(path)
        elif path.is_file() and needle in path.read_bytes():
            hits.append(path)
    return hits


# --------------------------------------------------------------------------------------------
# Root file system (cached), and chroots layered on it
# --------------------------------------------------------------------------------------------


def debian_mirrors() -> list[str]:
    """One-line apt sources for bookworm, using the Debian mirrors this machine's apt uses.

    The network here reaches only the mirrors already configured, so the main-archive and
    security URIs are taken from /etc/apt/sources.list(.d); FERRY_TEST_DEBIAN_MIRROR overrides
    the main archive.
    """
    archive: str | None = os.environ.get("FERRY_TEST_DEBIAN_MIRROR")
    security: str | None = None
    for uri, suites in _apt_sources():
        if any(s.endswith("-security") or s.endswith("/updates") for s in suites):
            security = security or uri
        elif archive is None and "debian" in uri:
            archive = uri
    archive = (archive or "http://deb.debian.org/debian").rstrip("/")
    lines = [f"deb {archive} {SUITE} main", f"deb {archive} {SUITE}-updates main"]
    if security:
        lines.append(f"deb {security.rstrip('/')} {SUITE}-security main")
    return lines


def _apt_sources() -> Iterator[tuple[str, list[str]]]:
    apt = Path("/etc/apt")
    files = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".list" or path.name == "sources.list":
            for line in text.splitlines():
                parts = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
                if len(parts) >= 3 and parts[0] == "deb":
                    yield parts[1], [parts[2]]
        elif path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = {
                    m.group(1).lower(): m.group(2).strip()
                    for m in re.finditer(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M)
                }
                if "deb" not in fields.get("types", "").split():
                    continue
                if fields.get("enabled", "yes").lower() == "no":
                    continue
                for uri in fields.get("uris", "").split():
                    yield uri, fields.get("suites", "").split()


def rootfs() -> Path:
    """A minimal bookworm root file system (apt variant + systemd + python3), as a directory.

    Made by mmdebstrap and cached under FERRY_TEST_CACHE (default ~/.cache/ferry-tests), keyed
    by the mirrors, the package list and the ISO week, so it is rebuilt (about a minute) at
    most weekly and whenever the inputs change; older ones are deleted. Never written to:
    every chroot is an overlay on it.
    """
    mirrors = debian_mirrors()
    key = hashlib.sha256("\n".join([SUITE, *ROOTFS_PACKAGES, *mirrors]).encode()).hexdigest()
    year, week, _ = datetime.date.today().isocalendar()
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tree = CACHE_DIR / f"{SUITE}-{key[:12]}-{year}w{week:02d}"
    with open(CACHE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others then reuse it
        if (tree / "usr" / "bin" / "python3").exists():
            return tree
        partial = CACHE_DIR / f"partial-{os.getpid()}"
        try:
            shutil.rmtree(partial, ignore_errors=True)
            run(["mmdebstrap", "--mode=root", "--variant=apt", "--quiet",
                 f"--include={','.join(ROOTFS_PACKAGES)}", SUITE, partial, *mirrors],
                timeout=900)
            shutil.rmtree(tree, ignore_errors=True)
            partial.rename(tree)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        for old in CACHE_DIR.glob(f"{SUITE}-*"):
            if old != tree:
                shutil.rmtree(old, ignore_errors=True)
    return tree


class Chroot:
    """A writable copy of the root file system: an overlay mount on it, at ``path``.

    Commands run in it with ``chroot``, each in its own mount namespace with /proc and a tmpfs
    /dev/shm mounted, so only the overlay itself is mounted on the host (until cleanup()).
    """

    def __init__(self, lower: Path, path: Path) -> None:
        self.path = path
        self._layer = path.with_name(path.name + ".layer")
        (self._layer / "upper").mkdir(parents=True)
        (self._layer / "work").mkdir()
        path.mkdir()
        run(["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={lower},upperdir={self._layer / 'upper'},workdir={self._layer / 'work'}",
             path])
        # dpkg fsyncs every unpacked file; that durability is not under test here, time is.
        (path / "etc/dpkg/dpkg.cfg.d/ferry-tests-unsafe-io").write_text("force-unsafe-io\n")
        self._background: list[subprocess.Popen[bytes]] = []

    def __truediv__(self, inner: str) -> Path:
        return self.path / inner.lstrip("/")

    def argv(self, command: Sequence[str], user: str | None = None) -> list[str]:
        inner = [*CLEAN_ENV, *command]
        if user is not None:
            inner = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", *inner]
        script = ('mount -t proc proc "$1/proc" && mount -t tmpfs -o mode=1777 tmpfs '
                  '"$1/dev/shm" && exec chroot "$@"')
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
                "sh", str(self.path), *inner]

    def run(self, *command: str, user: str | None = None, check: bool = True,
            timeout: float = 300, input: bytes | None = None,
            ) -> subprocess.CompletedProcess[str]:
        return run(self.argv(command, user), check=check, timeout=timeout, input=input)

    def start(self, *command: str, user: str | None = None, log: Path,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Run ``command`` in the background (its output to ``log``); stopped at cleanup."""
        argv = self.argv(command, user)
        if env:  # inserted after `env -i` so they survive the clean environment
            i = argv.index("env") + 2
            argv[i:i] = [f"{k}={v}" for k, v in env.items()]
        with log.open("ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT)
        self._background.append(proc)
        return proc

    def apt_install(self, deb: Path) -> subprocess.CompletedProcess[str]:
        """``apt-get install ./pkg.deb`` inside; its Depends come from the root file system."""
        inside = Path("/var/cache/apt/archives") / deb.name
        shutil.copy(deb, self / str(inside))
        try:
            return self.run("apt-get", "install", "-y", "-q", "-o",
                            "Dpkg::Options::=--force-confold", str(inside),
                            timeout=300)
        finally:
            (self / str(inside)).unlink(missing_ok=True)

    def stat(self, inner: str) -> os.stat_result:
        return os.lstat(self / inner)

    def names(self, uid: int, gid: int) -> tuple[str, str]:
        """Owner and group names of ids, as the chroot's /etc/passwd and /etc/group say."""
        users = _id_map(self / "etc/passwd")
        groups = _id_map(self / "etc/group")
        return users.get(uid, str(uid)), groups.get(gid, str(gid))

    def cleanup(self) -> None:
        for proc in self._background:
            stop_process(proc)
        if run(["umount", self.path], check=False).returncode != 0:
            run(["umount", "--lazy", self.path], check=False)
        shutil.rmtree(self._layer, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _id_map(path: Path) -> dict[int, str]:
    entries = {}
    for line in path.read_text().splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[2].isdigit():
            entries[int(fields[2])] = fields[0]
    return entries


def _pid_one_of_its_namespace(proc_dir: Path) -> bool:
    """Whether /proc/PID/status's NSpid line names the process PID 1 of a nested namespace."""
    for line in (proc_dir / "status").read_text().splitlines():
        if line.startswith("NSpid:"):
            ids = line.split()[1:]
            return len(ids) > 1 and ids[-1] == "1"
    return False


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """SIGTERM, wait, SIGKILL if it will not stop; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


# --------------------------------------------------------------------------------------------
# systemd-nspawn container: the root file system booted with systemd as PID 1
# --------------------------------------------------------------------------------------------


class Container:
    """The root file system booted under systemd-nspawn (no registration with machined).

    It shares the host's network (and so its loopback brokers) unless ``private_network``;
    /proc/sys is then read-only inside, so installing applies no sysctl to the host. Commands
    run inside through ``nsenter`` into the container's PID 1.
    """

    def __init__(self, lower: Path, path: Path, log: Path, *,
                 private_network: bool = False) -> None:
        self.chroot = Chroot(lower, path)
        self.name = f"ferrytest-{uuid.uuid4().hex[:8]}"
        network = ["--private-network"] if private_network else []
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", *network,
                 f"--machine={self.name}", "--console=passive", "-D", str(path), "--boot"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )
        self.log = log
        try:
            self.init_pid = wait_until(self._find_init, timeout=30,
                                       message="systemd in the container")
            try:
                state = wait_until(self._boot_finished, timeout=90,
                                   message="the container to finish booting")
            except AssertionError as exc:
                jobs = self.run("systemctl", "list-jobs", "--no-pager", check=False, timeout=20)
                raise AssertionError(f"{exc}\njobs:\n{jobs.stdout}{jobs.stderr}\n"
                                     f"nspawn:\n{self.logs()}") from exc
            assert state in ("running", "degraded"), f"container boot: {state}\n{self.logs()}"
        except BaseException:
            self.cleanup()
            raise

    def _find_init(self) -> int | None:
        """The nspawn child that is PID 1 of its own PID namespace.

        nspawn's short-lived outer child is also its child for a moment; taking that one (more
        likely on a loaded host) pointed every later nsenter at a process that had gone.
        """
        if self.proc.poll() is not None:
            raise AssertionError(f"systemd-nspawn exited {self.proc.returncode}:\n{self.logs()}")
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == self.proc.pid and _pid_one_of_its_namespace(stat.parent):
                    return int(stat.parent.name)
        return None

    def _boot_finished(self) -> str | None:
        if not Path(f"/proc/{self.init_pid}").exists():
            raise AssertionError(f"the container's init {self.init_pid} is gone:\n{self.logs()}")
        state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
        # "offline": systemctl cannot reach PID 1 yet.
        return None if state in ("offline", "initializing", "starting", "") else state

    def argv(self, command: Sequence[str], user: str | None = None) -> list[str]:
        inner = [*CLEAN_ENV, *command]
        if user is not None:
            inner = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", *inner]
        return ["nsenter", "--target", str(self.init_pid), "--all", "--root", "--wd", *inner]

    def run(self, *command: str, user: str | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run(self.argv(command, user), check=check, timeout=timeout)

    def logs(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-4000:]
        return ""

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "-o", "short-monotonic", "-u", unit,
                        check=False).stdout[-6000:]

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # nspawn: orderly poweroff of the container
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # Left by nspawn for --register=no containers; harmless but tidy up.
        shutil.rmtree(Path("/run/systemd/nspawn/propagate") / self.name, ignore_errors=True)
        self.chroot.cleanup()


# --------------------------------------------------------------------------------------------
# The agent's readiness, as systemd and a monitoring probe see it
# --------------------------------------------------------------------------------------------


class NotifyListener:
    """A stand-in for systemd's notification socket (the sd_notify protocol, Type=notify).

    An abstract-namespace datagram socket: reachable from a chroot, which shares this
    network namespace. Pass :attr:`address` to the agent as NOTIFY_SOCKET.
    """

    def __init__(self) -> None:
        name = f"ferry-tests-notify-{uuid.uuid4().hex}"
        self.address = "@" + name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + name)
        self._sock.settimeout(0.2)
        self.messages: list[str] = []

    def wait_for(self, line: str, process: subprocess.Popen[bytes], log: Path,
                 timeout: float = 60) -> None:
        """Until some notification carries ``line`` (READY=1, STOPPING=1)."""

        def seen() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"the agent exited {process.returncode} before {line}:\n"
                                     f"{log.read_text(errors='replace')[-4000:]}")
            with contextlib.suppress(TimeoutError):
                self.messages.append(self._sock.recv(4096).decode(errors="replace"))
            return any(line in m.splitlines() for m in self.messages)

        wait_until(seen, timeout=timeout, interval=0.01, message=f"{line} on NOTIFY_SOCKET")

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> NotifyListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def http_status(url: str, timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


if __name__ == "__main__":
    print(f"packaging: test prerequisites and root file system ready: {prepare()}")
