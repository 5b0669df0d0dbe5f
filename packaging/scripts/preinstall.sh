#!/bin/sh
# Ferry package: before unpacking. Creates the system users first, so that files in the
# package (/etc/ferry/ferry.toml, group ferry) get their owners at unpack time.
# Called as: deb `preinst install|upgrade [OLD]`, rpm `%pre 1|2`.
set -e

case "$1" in
  abort-upgrade) exit 0 ;;
esac

# The same entries as /usr/lib/sysusers.d/ferry.conf (not unpacked yet at this point; a test
# keeps the two identical).
sysusers_conf='g ferry-clients -
u ferry - "Ferry store-and-forward agent" /var/lib/ferry /usr/sbin/nologin
m ferry ferry-clients'

if command -v systemd-sysusers >/dev/null 2>&1; then
  printf '%s\n' "$sysusers_conf" | systemd-sysusers --replace=/usr/lib/sysusers.d/ferry.conf -
else
  getent group ferry-clients >/dev/null || groupadd --system ferry-clients
  if ! getent passwd ferry >/dev/null; then
    useradd --system --user-group --home-dir /var/lib/ferry --no-create-home \
      --shell /usr/sbin/nologin --comment "Ferry store-and-forward agent" ferry
  fi
  id -nG ferry | tr ' ' '\n' | grep -qx ferry-clients || usermod -a -G ferry-clients ferry
fi
exit 0
