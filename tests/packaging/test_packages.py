"""The .deb and .rpm built by packaging/build.sh, and the systemd service they install.

The .deb goes into minimal Debian bookworm root file systems (mmdebstrap, cached): installed
with apt, run as user ferry, upgraded, removed and purged; and booted under systemd-nspawn to
start ferry.service for real. The .rpm is inspected and installed into a scratch rpm root.
Needs root; selected with ``-m packaging``. See docs/packaging.md.
"""

from __future__ import annotations

import marshal
import os
import re
import stat
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.kafka import Broker, consume_all, create_topic, free_port, unique_topic_name
from tests.packaging import harness
from tests.packaging.harness import REPO_ROOT, Chroot, Container, Packages, run
from tests.waiting import wait_until

pytestmark = pytest.mark.packaging

CONFIG = "/etc/ferry/ferry.toml"
SOCKET = "/run/ferry/ferry.sock"
STAGE = REPO_ROOT / "build" / "packaging" / "root"

# What the package must leave on disk: path -> (owner, group, mode incl. setgid).
LAYOUT = {
    "/run/ferry": ("ferry", "ferry-clients", 0o2750),
    "/var/lib/ferry": ("ferry", "ferry-clients", 0o750),
    "/var/lib/ferry/buffer": ("ferry", "ferry", 0o700),
    "/var/lib/ferry/spool": ("ferry", "ferry-clients", 0o2770),
    "/etc/ferry": ("root", "root", 0o755),
    CONFIG: ("root", "ferry", 0o640),
    "/opt/ferry/bin/ferry": ("root", "root", 0o755),
    "/usr/lib/systemd/system/ferry.service": ("root", "root", 0o644),
    "/usr/lib/sysusers.d/ferry.conf": ("root", "root", 0o644),
    "/usr/lib/tmpfiles.d/ferry.conf": ("root", "root", 0o644),
    "/usr/lib/sysctl.d/60-ferry.conf": ("root", "root", 0o644),
}


def target_python() -> str:
    return run(["/usr/bin/python3", "-c",
                "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout.strip()


def agent_version() -> str:
    text = (REPO_ROOT / "agent" / "__init__.py").read_text()
    match = re.search(r"__version__\s*=\s*[\"']([^\"']+)", text)
    assert match
    return match.group(1)


def edit_config(root: Path, **replacements: str) -> str:
    """Rewrite ``key = ...`` lines of the installed config; returns the new text."""
    path = root / CONFIG.lstrip("/")
    text = path.read_text()
    for key, value in replacements.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert n == 1, f"{key} is not set exactly once in the packaged {CONFIG}"
    text += "\n# edited by the packaging tests\n"
    path.write_text(text)
    return text


def buffered(root: Chroot, topic: str) -> int:
    """Messages of ``topic`` in the installed agent's buffer (``ferry buffer topics``)."""
    out = root.run("ferry", "buffer", "--config", CONFIG, "topics", user="ferry").stdout
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0] == topic:
            return int(fields[1])
    return 0


def start_agent(
    root: Chroot, log: Path, notify: harness.NotifyListener
) -> subprocess.Popen[bytes]:
    """``ferry run`` as user ferry, as the unit runs it; returns once it sent READY=1."""
    agent = root.start("ferry", "run", "--config", CONFIG, user="ferry", log=log,
                       env={"NOTIFY_SOCKET": notify.address})
    notify.wait_for("READY=1", agent, log)
    return agent


# --------------------------------------------------------------------------------------------
# Build and payload
# --------------------------------------------------------------------------------------------


def test_build_writes_the_deb_and_the_rpm(packages: Packages) -> None:
    version = agent_version()
    assert packages.version == version
    assert packages.deb == REPO_ROOT / "dist" / f"ferry_{version}_{harness.deb_arch()}.deb"
    assert packages.rpm == REPO_ROOT / "dist" / f"ferry-{version}.{os.uname().machine}.rpm"

    fields = run(["dpkg-deb", "-f", packages.deb, "Package", "Version", "Depends"]).stdout
    py = target_python()
    major, minor = py.split(".")
    assert f"Version: {version}-1" in fields
    depends = re.search(r"^Depends: (.*)$", fields, re.M)
    assert depends, fields
    python, glibc = depends.group(1).rsplit(", ", 1)
    assert python == f"python3 (>= {py}), python3 (<< {major}.{int(minor) + 1})"
    glibc_min = re.fullmatch(r"libc6 \(>= (2\.\d+)\)", glibc)
    assert glibc_min, depends.group(1)
    requires = run(["rpm", "-qp", "--requires", packages.rpm]).stdout.splitlines()
    assert f"python(abi) = {py}" in requires
    assert f"glibc >= {glibc_min.group(1)}" in requires


@pytest.mark.parametrize("kind", ["deb", "rpm"])
def test_payload_is_relocated_to_opt_ferry_without_build_paths(
    packages: Packages, kind: str, tmp_path: Path
) -> None:
    if kind == "deb":
        root = harness.extract_deb(packages.deb, tmp_path / "payload")
    else:
        root = harness.extract_rpm(packages.rpm, tmp_path / "payload")

    for build_path in (STAGE, REPO_ROOT):
        leaks = harness.files_containing(root, str(build_path).encode())
        assert leaks == [], f"{build_path} appears in {[str(p) for p in leaks[:20]]}"

    venv = root / "opt" / "ferry"
    assert (venv / "bin" / "ferry").read_text().startswith("#!/opt/ferry/bin/python\n")
    assert os.readlink(root / "usr" / "bin" / "ferry") == "/opt/ferry/bin/ferry"
    assert os.readlink(venv / "bin" / "python3") == "/usr/bin/python3"
    assert os.readlink(venv / "bin" / "python") == "python3"
    cfg = dict(line.split(" = ", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines())
    assert cfg["home"] == "/usr/bin"
    assert cfg["include-system-site-packages"] == "false"
    assert cfg["command"] == "/usr/bin/python3 -m venv /opt/ferry"

    # Byte-code ships compiled for its final location (tracebacks name /opt/ferry/...).
    (site,) = venv.glob("lib/python3.*/site-packages")
    (pyc,) = (site / "agent" / "cli" / "__pycache__").glob("main.cpython-*.pyc")
    code = marshal.loads(pyc.read_bytes()[16:])
    main = site / "agent" / "cli" / "main.py"
    assert code.co_filename == f"/opt/ferry/{main.relative_to(venv)}"


def test_deb_depends_on_the_c_library_its_compiled_modules_need(packages: Packages,
                                                                tmp_path: Path) -> None:
    # The floor build.sh reads from the wheels' manylinux tags must cover every glibc symbol
    # version the venv's shared objects actually import (objdump comes with lintian).
    depends = run(["dpkg-deb", "-f", packages.deb, "Depends"]).stdout
    declared = re.search(r"libc6 \(>= 2\.(\d+)\)", depends)
    assert declared, depends
    root = harness.extract_deb(packages.deb, tmp_path / "payload")
    objects = [p for p in (root / "opt" / "ferry").rglob("*.so*") if p.is_file()]
    assert objects, "no compiled modules in the venv?"
    needed = set()
    for obj in objects:
        symbols = run(["objdump", "-T", obj]).stdout
        needed |= {int(m) for m in re.findall(r"\bGLIBC_2\.(\d+)", symbols)}
    assert needed, "no glibc symbols found: objdump output changed?"
    assert max(needed) <= int(declared.group(1)), \
        f"modules need GLIBC_2.{max(needed)}, the package says {declared.group(0)}"


def test_maintainer_is_a_real_address_and_the_changelog_names_this_version(
    packages: Packages, tmp_path: Path
) -> None:
    author = run(["git", "-c", f"safe.directory={REPO_ROOT}", "-C", REPO_ROOT, "log", "-1",
                  "--format=%an <%ae>"]).stdout.strip()
    assert run(["dpkg-deb", "-f", packages.deb, "Maintainer"]).stdout.strip() == author
    assert run(["rpm", "-qp", "--qf", "%{PACKAGER}", packages.rpm]).stdout == author
    assert "@localhost" not in author

    root = harness.extract_deb(packages.deb, tmp_path / "payload")
    changelog = run(["zcat", root / "usr/share/doc/ferry/changelog.Debian.gz"]).stdout
    assert changelog.startswith(f"ferry ({packages.version}-1) unstable; urgency=medium\n")
    assert f"\n -- {author}  " in changelog
    rpm_log = run(["rpm", "-qp", "--changelog", packages.rpm]).stdout
    assert rpm_log.startswith("* ") and f"{author} - {packages.version}-1\n" in rpm_log
    assert (root / "usr/share/doc/ferry/copyright").read_text() == \
        (harness.PACKAGING / "copyright").read_text()


def test_build_refuses_a_local_maintainer_address(tmp_path: Path) -> None:
    # Checked before anything is built, so this costs no build.
    result = run([harness.PACKAGING / "build.sh", "--out", tmp_path, "--maintainer",
                  "Ferry <ferry@localhost>"], check=False, timeout=60)
    assert result.returncode == 1
    assert "a local address reaches nobody" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_deb_has_no_lintian_errors_and_every_override_is_used_and_explained(
    packages: Packages,
) -> None:
    result = run(["lintian", "--info", "--tag-display-limit", "0", "--fail-on", "error",
                  packages.deb], check=False, timeout=300)
    tags = [line for line in result.stdout.splitlines() if re.match(r"[EWIPX]: ", line)]
    errors = [line for line in tags if line.startswith("E: ")]
    assert result.returncode == 0 and errors == [], "\n".join(errors) or result.stderr
    stale = [line for line in tags if "unused-override" in line or "mismatched-override" in line]
    assert stale == [], "\n".join(stale)
    # What the issue found: now fixed, or overridden only where the bundled venv needs it.
    for fixed in ("no-copyright-file", "no-changelog", "bogus-mail-host",
                  "missing-dependency-on-libc", "malformed-deb-archive",
                  "extended-description-line-too-long", "script-not-executable"):
        assert not [line for line in tags if f" {fixed} " in f"{line} "], fixed
    _assert_each_override_has_a_comment(harness.PACKAGING / "lintian-overrides",
                                        lambda line: line.startswith("ferry: "))


def test_rpm_has_no_rpmlint_errors_and_every_filter_is_used_and_explained(
    packages: Packages,
) -> None:
    # rpmlint reports a filter that matched nothing as an error (unused-rpmlintrc-filter).
    rc = harness.PACKAGING / "rpmlintrc"
    result = run(["rpmlint", "-r", rc, packages.rpm], check=False, timeout=300)
    summary = re.search(r"(\d+) errors, (\d+) warnings", result.stdout)
    assert summary, result.stdout[-2000:] + result.stderr
    errors = [line for line in result.stdout.splitlines() if ": E: " in line]
    assert result.returncode == 0 and summary.group(1) == "0", "\n".join(errors)
    _assert_each_override_has_a_comment(rc, lambda line: line.startswith("addFilter("))


def _assert_each_override_has_a_comment(path: Path, is_override: Callable[[str], bool]) -> None:
    """Every override sits in a block (no blank line between) that starts with a comment."""
    blocks = path.read_text().split("\n\n")
    overrides = 0
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        if any(is_override(line) for line in lines):
            overrides += sum(1 for line in lines if is_override(line))
            assert lines[0].startswith("#"), f"{path.name}: no comment says why:\n{block}"
    assert overrides > 0, f"{path.name}: no overrides found"


def test_payload_has_the_base_dependencies_and_no_extras(packages: Packages,
                                                         tmp_path: Path) -> None:
    root = harness.extract_deb(packages.deb, tmp_path / "payload")
    (site,) = (root / "opt" / "ferry").glob("lib/python3.*/site-packages")
    installed = {_canonical(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {_canonical(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in requirements}

    base = names(project["dependencies"])
    extras = set().union(*(names(reqs) for reqs in project["optional-dependencies"].values()))
    assert "ferry" in installed
    assert base <= installed, f"missing: {base - installed}"
    assert not (extras - base) & installed, f"extras installed: {(extras - base) & installed}"
    assert not {"pip", "setuptools", "wheel"} & installed


def test_payload_has_every_module_and_data_file_of_the_source_tree(
    packages: Packages, tmp_path: Path
) -> None:
    # pyproject.toml lists packages explicitly: a new subpackage missing from that list would
    # be left out of the wheel, and the installed agent would fail to import it.
    root = harness.extract_deb(packages.deb, tmp_path / "payload")
    (site,) = (root / "opt" / "ferry").glob("lib/python3.*/site-packages")
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    top_level = {name.split(".")[0] for name in setuptools["packages"]}
    expected = set()
    for top in top_level:
        for source in (REPO_ROOT / top).rglob("*.py"):
            expected.add(source.relative_to(REPO_ROOT))
    for package, patterns in setuptools.get("package-data", {}).items():
        base = REPO_ROOT / package.replace(".", "/")
        for pattern in patterns:
            expected |= {p.relative_to(REPO_ROOT) for p in base.glob(pattern) if p.is_file()}
    missing = sorted(str(p) for p in expected if not (site / p).is_file())
    assert missing == [], f"not in the package: {missing}"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --------------------------------------------------------------------------------------------
# Unit and system integration files
# --------------------------------------------------------------------------------------------


def test_unit_security_exposure_is_at_most_4() -> None:
    result = run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                  harness.PACKAGING / "ferry.service"], check=False)
    match = re.search(r"Overall exposure level for ferry\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= 4.0, result.stdout


def test_preinstall_creates_exactly_the_sysusers_entries() -> None:
    # preinstall runs before /usr/lib/sysusers.d/ferry.conf is unpacked, so it carries a copy.
    script = (harness.PACKAGING / "scripts" / "preinstall.sh").read_text()
    match = re.search(r"sysusers_conf='([^']*)'", script)
    assert match
    conf = (harness.PACKAGING / "sysusers.conf").read_text()
    entries = [line for line in conf.splitlines() if line and not line.startswith("#")]
    assert match.group(1).splitlines() == entries


def test_postinstall_fallback_makes_the_tmpfiles_directories() -> None:
    # Without a usable systemd-tmpfiles, postinstall creates the same directories by hand.
    tmpfiles = {}
    for line in (harness.PACKAGING / "tmpfiles.conf").read_text().splitlines():
        if line and not line.startswith("#"):
            _type, path, mode, user, group, _age = line.split()
            tmpfiles[path] = (user, group, mode)
    script = (harness.PACKAGING / "scripts" / "postinstall.sh").read_text()
    fallback = {
        m.group(4): (m.group(1), m.group(2), m.group(3))
        for m in re.finditer(r"install -d -o (\S+) -g (\S+)\s+-m (\d+) (\S+)", script)
    }
    assert fallback == tmpfiles
    for path, (user, group, mode) in tmpfiles.items():
        assert LAYOUT[path] == (user, group, int(mode, 8))


# --------------------------------------------------------------------------------------------
# The .deb in a Debian chroot
# --------------------------------------------------------------------------------------------


def test_deb_installs_users_directories_config_and_unit(packages: Packages,
                                                       chroot: Chroot) -> None:
    chroot.apt_install(packages.deb)

    passwd = {line.split(":")[0]: line.split(":") for line in
              (chroot / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":") for line in
              (chroot / "etc/group").read_text().splitlines()}
    ferry = passwd["ferry"]
    assert int(ferry[2]) < 1000, "ferry must be a system user"
    assert ferry[5:] == ["/var/lib/ferry", "/usr/sbin/nologin"]
    assert groups["ferry"][2] == ferry[3], "ferry's primary group is ferry"
    assert groups["ferry-clients"][3].split(",") == ["ferry"]

    for path, (owner, group, mode) in LAYOUT.items():
        st = chroot.stat(path)
        assert chroot.names(st.st_uid, st.st_gid) == (owner, group), path
        assert stat.S_IMODE(st.st_mode) == mode, f"{path}: {oct(stat.S_IMODE(st.st_mode))}"
    for installed in (chroot / "opt/ferry").rglob("*"):
        st = installed.lstat()
        assert st.st_uid == 0 and st.st_gid == 0, installed
        assert stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o022, f"{installed} is writable"

    conffiles = chroot.run("dpkg-query", "-W", "-f=${Conffiles}", "ferry").stdout.split()
    assert CONFIG in conffiles

    verify = chroot.run("systemd-analyze", "verify", "/usr/lib/systemd/system/ferry.service")
    assert (verify.stdout, verify.stderr) == ("", "")

    version = f"ferry {packages.version}"
    assert chroot.run("ferry", "--version").stdout.strip() == version
    assert chroot.run("ferry", "--version", user="ferry").stdout.strip() == version


def test_deb_agent_runs_as_ferry_and_accepts_a_message(
    packages: Packages, chroot: Chroot, broker: Broker, tmp_path: Path
) -> None:
    chroot.apt_install(packages.deb)
    topic = unique_topic_name("packaged-agent")
    create_topic(broker.bootstrap, topic)
    http = f"127.0.0.1:{free_port()}"
    edit_config(chroot.path, bootstrap_servers=f'"{broker.bootstrap}"', listen=f'"{http}"')
    chroot.run("useradd", "--groups", "ferry-clients", "alice")
    chroot.run("useradd", "mallory")

    log = tmp_path / "agent.log"
    with harness.NotifyListener() as notify:
        agent = start_agent(chroot, log, notify)
        uid = int(chroot.run("id", "-u", "ferry").stdout)
        status = Path(f"/proc/{agent.pid}/status").read_text()
        assert re.search(rf"^Uid:\s+{uid}\s+{uid}\s", status, re.M), status
        assert harness.http_status(f"http://{http}/status/ready") == 200

        st = chroot.stat(SOCKET)
        assert stat.S_ISSOCK(st.st_mode)
        assert chroot.names(st.st_uid, st.st_gid) == ("ferry", "ferry-clients")
        assert stat.S_IMODE(st.st_mode) == 0o660

        chroot.run("ferry", "send", "--socket-path", SOCKET, "--topic", topic,
                   "--value", "hello from alice", user="alice")
        denied = chroot.run("ferry", "send", "--socket-path", SOCKET, "--topic", topic,
                            "--value", "from outside the group", user="mallory", check=False)
        assert denied.returncode != 0, "a user outside ferry-clients could write the socket"

        got = consume_all(broker.bootstrap, topic, 1, timeout=30)
        assert [m.value for m in got] == [b"hello from alice"]
        assert harness.stop_process(agent) == 0, log.read_text()[-4000:]


def test_deb_upgrade_keeps_the_edited_config_and_buffered_messages(
    packages: Packages, upgrade_deb: Path, chroot: Chroot, tmp_path: Path
) -> None:
    chroot.apt_install(packages.deb)
    kafka_port = free_port()  # nothing listens here until after the upgrade
    topic = unique_topic_name("upgrade")
    edited = edit_config(chroot.path, bootstrap_servers=f'"127.0.0.1:{kafka_port}"',
                         listen=f'"127.0.0.1:{free_port()}"')
    chroot.run("useradd", "--groups", "ferry-clients", "alice")

    values = [f"before upgrade {i}".encode() for i in range(3)]
    with harness.NotifyListener() as notify:
        agent = start_agent(chroot, tmp_path / "agent-1.log", notify)
        for value in values:
            chroot.run("ferry", "send", "--socket-path", SOCKET, "--topic", topic,
                       "--value", value.decode(), user="alice")
        wait_until(lambda: buffered(chroot, topic) == 3, timeout=30,
                   message="3 messages in the buffer")
        assert harness.stop_process(agent) == 0

    chroot.apt_install(upgrade_deb)
    status = chroot.run("dpkg-query", "-W", "-f=${Version} ${Status}", "ferry").stdout
    assert status == f"{packages.version}+upgrade1-1 install ok installed"
    assert (chroot / CONFIG).read_text() == edited
    assert not list((chroot / "etc/ferry").glob("ferry.toml.*")), "dpkg left a conffile copy"
    assert buffered(chroot, topic) == 3

    with Broker(kafka_port, log_path=tmp_path / "tansu.log") as broker, \
            harness.NotifyListener() as notify:
        agent = start_agent(chroot, tmp_path / "agent-2.log", notify)
        got = consume_all(broker.bootstrap, topic, 3, timeout=60)
        assert sorted(m.value or b"" for m in got) == values
        assert harness.stop_process(agent) == 0


def test_deb_remove_keeps_data_and_purge_deletes_it(packages: Packages,
                                                    chroot: Chroot) -> None:
    chroot.apt_install(packages.deb)
    # Stand-ins for undelivered messages and a spooled file.
    chroot.run("sh", "-c", "echo undelivered > /var/lib/ferry/buffer/data.mdb", user="ferry")
    chroot.run("sh", "-c", "echo spooled > /var/lib/ferry/spool/batch.spool", user="ferry")
    edited = edit_config(chroot.path, listen='"127.0.0.1:9191"')

    chroot.run("apt-get", "remove", "-y", "-q", "ferry")
    for gone in ("/opt/ferry", "/usr/bin/ferry", "/usr/lib/systemd/system/ferry.service"):
        assert not os.path.lexists(chroot / gone), gone
    assert (chroot / CONFIG).read_text() == edited
    assert (chroot / "var/lib/ferry/buffer/data.mdb").read_text() == "undelivered\n"
    assert (chroot / "var/lib/ferry/spool/batch.spool").exists()

    chroot.run("apt-get", "purge", "-y", "-q", "ferry")
    for gone in ("/etc/ferry", "/var/lib/ferry", "/run/ferry"):
        assert not os.path.lexists(chroot / gone), gone
    assert chroot.run("dpkg-query", "-W", "ferry", check=False).returncode != 0
    # The users stay (files they own may remain elsewhere), as documented.
    assert chroot.run("id", "ferry").returncode == 0


# --------------------------------------------------------------------------------------------
# ferry.service under systemd (the root file system booted with systemd-nspawn)
# --------------------------------------------------------------------------------------------

# Loads every compiled dependency the way the agent does, inside the unit's sandbox
# (MemoryDenyWriteExecute, SystemCallFilter, ProtectSystem=strict, ...), then reports ready.
SANDBOX_PROBE = r'''
import ctypes, os, socket, asyncio
import lmdb, confluent_kafka, uvloop, httptools, pydantic_core, fastavro
import watchdog.events, watchdog.observers
ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)()          # a libffi closure: needs no W+X memory
env = lmdb.open("/var/lib/ferry/buffer/probe", map_size=1 << 24)
with env.begin(write=True) as txn:
    txn.put(b"k", b"v")
env.sync(True)
confluent_kafka.Producer({"bootstrap.servers": "127.0.0.1:9"}).flush(0)
uvloop.run(asyncio.sleep(0))
observer = watchdog.observers.Observer()
observer.schedule(watchdog.events.FileSystemEventHandler(), "/var/lib/ferry/spool")
observer.start()
observer.stop()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.bind("/run/ferry/ferry.sock")
os.chmod("/run/ferry/ferry.sock", 0o660)
notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
address = os.environ["NOTIFY_SOCKET"]
notify.sendto(b"READY=1", "\0" + address[1:] if address.startswith("@") else address)
socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).recv(1)  # until stopped
'''


def container_install(container: Container, deb: Path) -> None:
    inside = Path("/var/cache/apt/archives") / deb.name
    (container.chroot / str(inside)).write_bytes(deb.read_bytes())
    container.run("apt-get", "install", "-y", "-q", str(inside), timeout=300)


def unit_state(container: Container) -> dict[str, str]:
    out = container.run("systemctl", "show", "ferry.service", "--property",
                        "ActiveState,SubState,Result,NRestarts,MainPID").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_unit_sandbox_lets_the_venv_libraries_work(packages: Packages,
                                                  isolated_container: Container) -> None:
    container = isolated_container
    container_install(container, packages.deb)
    # With systemd running, postinstall applied the sysctl drop-in (in the container's own
    # network namespace).
    qlen = container.run("cat", "/proc/sys/net/unix/max_dgram_qlen").stdout.strip()
    assert qlen == "4096"

    (container.chroot / "usr/local/lib/ferry-probe.py").write_text(SANDBOX_PROBE)
    dropin = container.chroot / "etc/systemd/system/ferry.service.d/probe.conf"
    dropin.parent.mkdir(parents=True)
    dropin.write_text("[Service]\nExecStart=\n"
                      "ExecStart=/opt/ferry/bin/python /usr/local/lib/ferry-probe.py\n")
    container.run("systemctl", "daemon-reload")

    started = container.run("systemctl", "start", "ferry.service", check=False, timeout=90)
    state = unit_state(container)
    assert started.returncode == 0 and state["SubState"] == "running", \
        f"{state}\n{container.journal('ferry.service')}"
    # /run is the container's own tmpfs: look from inside.
    socket_stat = container.run("stat", "-c", "%U %G %a %F", SOCKET).stdout.strip()
    assert socket_stat == "ferry ferry-clients 660 socket"
    container.run("systemctl", "stop", "ferry.service")
    assert unit_state(container)["ActiveState"] == "inactive"


def test_service_starts_under_systemd_and_accepts_messages(
    packages: Packages, container: Container, broker: Broker
) -> None:
    container_install(container, packages.deb)
    topic = unique_topic_name("systemd")
    create_topic(broker.bootstrap, topic)
    http = f"127.0.0.1:{free_port()}"
    edit_config(container.chroot.path, bootstrap_servers=f'"{broker.bootstrap}"',
                listen=f'"{http}"')
    container.run("useradd", "--groups", "ferry-clients", "alice")

    # Type=notify: `systemctl start` returns once the agent sent READY=1.
    started = container.run("systemctl", "start", "ferry.service", check=False, timeout=120)
    state = unit_state(container)
    assert started.returncode == 0, f"{state}\n{container.journal('ferry.service')}"
    assert (state["ActiveState"], state["SubState"], state["NRestarts"]) == \
        ("active", "running", "0"), container.journal("ferry.service")
    assert harness.http_status(f"http://{http}/status/ready") == 200

    container.run("ferry", "send", "--socket-path", SOCKET, "--topic", topic,
                  "--value", "via systemd", user="alice")
    got = consume_all(broker.bootstrap, topic, 1, timeout=30)
    assert [m.value for m in got] == [b"via systemd"]

    # The buffer's writer thread, and only it, runs at buffer.writer_nice (-5), which the
    # unit's LimitNICE (RLIMIT_NICE 25) and its system call filter allow (docs/buffer.md).
    # systemd can raise that limit only with CAP_SYS_RESOURCE; where its host lacks it (this
    # CI machine's root does), the limit stays 0 and the agent must log the refusal and run on.
    assert container.run("systemctl", "show", "-p", "LimitNICE", "--value",
                         "ferry.service").stdout.strip() == "25"
    pid = container.run("systemctl", "show", "-p", "MainPID", "--value",
                        "ferry.service").stdout.strip()
    limits = container.run("cat", f"/proc/{pid}/limits").stdout
    granted = re.search(r"Max nice priority\s+(\d+)", limits)
    assert granted, limits
    nices = container.run("sh", "-c", f"for t in /proc/{pid}/task/*; do "
                          f"sed 's/.*) //' $t/stat | cut -d' ' -f17; done").stdout.split()
    if granted.group(1) == "25":
        assert nices.count("-5") == 1 and set(nices) == {"0", "-5"}, nices
    else:
        assert set(nices) == {"0"}, nices
        assert "setting it to -5 was refused" in container.journal("ferry.service")

    security = container.run("systemd-analyze", "security", "--no-pager", "ferry.service",
                             check=False).stdout
    match = re.search(r"Overall exposure level for ferry\.service: (\d+\.\d+)", security)
    assert match and float(match.group(1)) <= 4.0, security

    # Purging stops the service first (preremove) and then deletes its state.
    container.run("apt-get", "purge", "-y", "-q", "ferry")
    owners = container.run("sh", "-c", "stat -c %U /proc/[0-9]* 2>/dev/null",
                           check=False).stdout.split()
    assert "ferry" not in owners, "a ferry process survived the purge"
    assert not os.path.lexists(container.chroot / "var/lib/ferry")


# --------------------------------------------------------------------------------------------
# The .rpm
# --------------------------------------------------------------------------------------------


def test_rpm_payload_config_and_scripts_match_the_deb(packages: Packages) -> None:
    rpm_files = set(run(["rpm", "-qlp", packages.rpm]).stdout.splitlines())
    deb_files = {line.split(None, 5)[5].split(" -> ")[0].removeprefix(".").rstrip("/")
                 for line in run(["dpkg-deb", "-c", packages.deb]).stdout.splitlines()}
    owned_dirs = {"/opt", "/usr", "/usr/bin", "/usr/lib", "/usr/lib/systemd", "/etc", "",
                  "/usr/lib/systemd/system", "/usr/lib/sysusers.d", "/usr/lib/tmpfiles.d",
                  "/usr/lib/sysctl.d", "/usr/share", "/usr/share/doc"}
    # Debian's own: the lintian overrides and the changelog (the rpm's is in its header).
    deb_only = {"/usr/share/lintian", "/usr/share/lintian/overrides",
                "/usr/share/lintian/overrides/ferry", "/usr/share/doc/ferry/changelog.Debian.gz"}
    assert deb_only <= deb_files
    assert rpm_files == deb_files - owned_dirs - deb_only

    flags = run(["rpm", "-qp", "--qf",
                 "[%{FILENAMES}\t%{FILEFLAGS:fflags}\t%{FILEMODES:octal}\t"
                 "%{FILEUSERNAME}:%{FILEGROUPNAME}\n]", packages.rpm]).stdout
    config = [line.split("\t") for line in flags.splitlines() if "c" in line.split("\t")[1]]
    assert config == [[CONFIG, "cn", "100640", "root:ferry"]]  # %config(noreplace)

    scripts = run(["rpm", "-qp", "--scripts", packages.rpm]).stdout
    for name in ("preinstall", "postinstall", "preremove", "postremove"):
        body = (harness.PACKAGING / "scripts" / f"{name}.sh").read_text()
        assert body.strip() in scripts, f"{name}.sh is not the rpm's scriptlet"
    for scriptlet in ("preinstall", "postinstall", "preuninstall", "postuninstall"):
        assert f"{scriptlet} scriptlet (using /bin/sh)" in scripts


def test_rpm_installs_into_a_scratch_root(packages: Packages, rootfs: Path,
                                          tmp_path: Path) -> None:
    # The scratch root is the Debian root file system: its /bin/sh, systemd-sysusers and
    # useradd run the scriptlets. --nodeps: nothing on Debian provides python(abi).
    root = Chroot(rootfs, tmp_path / "rpmroot")
    try:
        rpm = ["rpm", "--root", str(root.path), "--dbpath", "/var/lib/rpm"]
        run([*rpm, "--initdb"])
        run([*rpm, "--nodeps", "-i", packages.rpm], timeout=300)
        assert run([*rpm, "-q", "ferry"]).stdout.strip() == \
            f"ferry-{packages.version}-1.{os.uname().machine}"
        run([*rpm, "-V", "--nodeps", "ferry"])  # every file as packaged (mode, owner, digest)

        assert root.run("id", "-nG", "ferry").stdout.split() == ["ferry", "ferry-clients"]
        for path, (owner, group, mode) in LAYOUT.items():
            st = root.stat(path)
            assert root.names(st.st_uid, st.st_gid) == (owner, group), path
            assert stat.S_IMODE(st.st_mode) == mode, path
        version = root.run("ferry", "--version", user="ferry").stdout.strip()
        assert version == f"ferry {packages.version}"

        run([*rpm, "-e", "ferry"])
        assert not os.path.lexists(root / "opt/ferry")
        assert not os.path.lexists(root / CONFIG)
        # rpm has no purge: the buffer (undelivered messages) stays until deleted by hand.
        assert (root / "var/lib/ferry/buffer").is_dir()
    finally:
        root.cleanup()
