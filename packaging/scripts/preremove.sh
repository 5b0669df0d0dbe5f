#!/bin/sh
# Ferry package: before removing the files. Stops the service on removal (not on upgrade,
# where the postinstall script restarts it).
# Called as: deb `prerm remove|upgrade|deconfigure|failed-upgrade`, rpm `%preun 0|1`.
set -e

case "$1" in
  remove|deconfigure|0) ;;
  *) exit 0 ;;
esac

if [ -d /run/systemd/system ]; then
  systemctl stop ferry.service || true
fi
exit 0
