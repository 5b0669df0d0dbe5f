#!/bin/sh
# Ferry package: after removing the files.
# deb purge: deletes /var/lib/ferry, i.e. THE BUFFER WITH EVERY UNDELIVERED MESSAGE, and the
# spool. A plain remove keeps /var/lib/ferry and /etc/ferry/ferry.toml. rpm has no purge: an
# erase keeps /var/lib/ferry (delete it by hand). The users ferry and ferry-clients stay, as
# files owned by them may remain.
# Called as: deb `postrm remove|purge|upgrade|abort-*|...`, rpm `%postun 0|1`.
set -e

case "$1" in
  purge)
    rm -rf /var/lib/ferry /run/ferry
    rm -f /etc/systemd/system/multi-user.target.wants/ferry.service
    # The management token (created by postinst, not a file of the package), then the
    # directory dpkg could not remove while the token was in it.
    rm -f /etc/ferry/management.token
    rmdir /etc/ferry 2>/dev/null || true
    ;;
  0)
    rm -f /etc/systemd/system/multi-user.target.wants/ferry.service
    ;;
esac

if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
fi
exit 0
