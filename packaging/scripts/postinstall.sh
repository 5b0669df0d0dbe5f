#!/bin/sh
# Ferry package: after unpacking. Creates /run/ferry and /var/lib/ferry/{buffer,spool}, and,
# when systemd is running (not in a chroot or image build), applies the sysctl drop-in,
# reloads units and restarts a running ferry.service on upgrade. A fresh install does not
# start the service: point /etc/ferry/ferry.toml at Kafka, then `systemctl enable --now ferry`.
# Called as: deb `postinst configure [OLD]`, rpm `%post 1|2`.
set -e

upgrade=0
case "$1" in
  configure) [ -z "$2" ] || upgrade=1 ;;
  1) ;;
  2) upgrade=1 ;;
  *) exit 0 ;;  # abort-upgrade, abort-remove, ...: nothing was changed
esac

if command -v systemd-sysusers >/dev/null 2>&1; then
  systemd-sysusers /usr/lib/sysusers.d/ferry.conf
fi

# systemd-tmpfiles needs /proc; fall back to the same directories by hand (chroots, image
# builds). The entries match /usr/lib/tmpfiles.d/ferry.conf.
if ! { command -v systemd-tmpfiles >/dev/null 2>&1 \
       && systemd-tmpfiles --create /usr/lib/tmpfiles.d/ferry.conf 2>/dev/null; }; then
  install -d -o ferry -g ferry-clients -m 2750 /run/ferry
  install -d -o ferry -g ferry-clients -m 0750 /var/lib/ferry
  install -d -o ferry -g ferry         -m 0700 /var/lib/ferry/buffer
  install -d -o ferry -g ferry-clients -m 2770 /var/lib/ferry/spool
fi

# -- management token (HTTP topic management; docs/http.md, "Management") -----------------
# Topic management is closed without a token. Created once (an upgrade keeps it), readable
# by root and the ferry-admin group, whose members may run `ferry topics`; the unit hands it
# to the agent with LoadCredential=.
getent group ferry-admin >/dev/null || groupadd --system ferry-admin
token=/etc/ferry/management.token
if [ ! -e "$token" ]; then
  (umask 0137 && od -An -N24 -tx1 /dev/urandom | tr -d ' \n' > "$token" && echo >> "$token")
  chown root:ferry-admin "$token"
  chmod 0640 "$token"
fi
# -- end of management token --------------------------------------------------------------

if [ -d /run/systemd/system ]; then
  for sysctl in /usr/lib/systemd/systemd-sysctl /lib/systemd/systemd-sysctl; do
    if [ -x "$sysctl" ]; then
      "$sysctl" /usr/lib/sysctl.d/60-ferry.conf || true
      break
    fi
  done
  systemctl daemon-reload || true
  if [ "$upgrade" = 1 ]; then
    systemctl try-restart ferry.service || true
  fi
fi
exit 0
