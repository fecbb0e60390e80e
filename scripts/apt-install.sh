#!/bin/sh
# Install those of the Debian packages named that are missing (sudo unless root).
set -e
missing=""
for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
[ -z "$missing" ] && exit 0
echo "installing Debian packages:$missing"
SUDO=$( [ "$(id -u)" = 0 ] || echo sudo )
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing </dev/null
