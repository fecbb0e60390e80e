#!/bin/sh
# Install awscrt with third_party/awscrt/recvfile.patch into the venv VENV
# (third_party/README.md): the binding's S3Client.make_request gains
# recv_file_option / recv_file_position / recv_file_delete_on_failure, so the
# runtime can write a GET's body into an existing file (a tier-1 cache file) at
# a position, in its own threads. Built from the hash-pinned PyPI sdist against
# the system's libcrypto (no aws-lc to compile); the wheel is cached under
# build/third_party, keyed by the pins, this script and the patch, so a second
# run only installs.
#
# Usage: third_party/awscrt/build.sh VENV [patched|stock]
# `stock`, or any failure of the build: stock awscrt from PyPI, with one line
# saying why; tierfs then hands each GET body to Python (store/crt.py).
set -eu

# -- pins ----------------------------------------------------------------------
AWSCRT=0.38.1
AWSCRT_SHA256=0dcebfaa70cf079133cd2352119e3d05e9b8ca1d1621736cfb54c03f3d5fef0f
TOOLS="setuptools==80.9.0"
BUILD_DEB="cmake libssl-dev"   # the runtime's build; libcrypto instead of building aws-lc

VENV=$(cd "$1" && pwd)
MODE=${2:-patched}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$(dirname "$HERE")")
B=$ROOT/build/third_party
PATCH=$HERE/recvfile.patch
mkdir -p "$B"
LOG=$B/awscrt-build.log
: >"$LOG"

at() { echo "step: $(date +%T) $*" >>"$LOG"; }
say() { echo "third_party: $*"; }

stock() {
    say "awscrt writes into tier-1 files unavailable: $1; installing stock awscrt $AWSCRT (GET bodies pass through Python)"
    # A patched 0.38.1+recvfile would satisfy ==0.38.1: remove it first.
    "$VENV/bin/pip" uninstall -q -y awscrt >/dev/null 2>&1 || true
    "$VENV/bin/pip" install -q "awscrt==$AWSCRT"
    exit 0
}

[ "$MODE" = stock ] && stock "stock build requested"
[ "$MODE" = patched ] || { echo "third_party/awscrt/build.sh: mode must be patched or stock, not '$MODE'" >&2; exit 2; }

KEY=$(cat "$0" "$PATCH" | sha256sum | cut -c1-12)
WHEELS=$B/awscrt-wheels-$KEY

tool_venv() {
    TOOLVENV=$B/venv-awscrt
    key=$(echo "$TOOLS" | sha256sum | cut -c1-12)
    [ -f "$TOOLVENV/.tools-$key" ] && return 0
    at "creating the build venv ($TOOLS)"
    rm -rf "$TOOLVENV"
    python3 -m venv "$TOOLVENV" >>"$LOG" 2>&1
    "$TOOLVENV/bin/pip" install -q $TOOLS >>"$LOG" 2>&1
    touch "$TOOLVENV/.tools-$key"
}

build_wheel() {
    ls "$WHEELS"/awscrt-*.whl >/dev/null 2>&1 && return 0
    at "downloading the awscrt $AWSCRT sdist (PyPI, hash-pinned)"
    rm -rf "$B/awscrt" "$B"/awscrt-wheels-* && mkdir -p "$B/awscrt"
    echo "awscrt==$AWSCRT --hash=sha256:$AWSCRT_SHA256" >"$B/awscrt/req.txt"
    "$TOOLVENV/bin/pip" download -q --no-deps --no-binary awscrt --no-build-isolation --require-hashes \
        -r "$B/awscrt/req.txt" -d "$B/awscrt" >>"$LOG" 2>&1
    at "patching awscrt $AWSCRT (third_party/awscrt/recvfile.patch)"
    tar xzf "$B/awscrt/awscrt-$AWSCRT.tar.gz" -C "$B/awscrt"
    sdist=$B/awscrt/awscrt-$AWSCRT
    patch -d "$sdist" -p1 --forward --quiet <"$PATCH" >>"$LOG" 2>&1
    at "building awscrt $AWSCRT+recvfile (cmake, gcc; the system's libcrypto)"
    mkdir -p "$WHEELS.tmp"
    (cd "$sdist" && AWS_CRT_BUILD_USE_SYSTEM_LIBCRYPTO=1 \
        "$TOOLVENV/bin/pip" wheel -q --no-deps --no-build-isolation -w "$WHEELS.tmp" .) >>"$LOG" 2>&1
    mv "$WHEELS.tmp" "$WHEELS"
    rm -rf "$B/awscrt"   # the unpacked sources and cmake's tree: ~0.5 GB
}

install_into_venv() {
    at "installing awscrt $AWSCRT+recvfile into $VENV"
    "$VENV/bin/pip" install -q --force-reinstall --no-deps "$WHEELS"/awscrt-*.whl >>"$LOG" 2>&1
    at "checking the installed awscrt"
    "$VENV/bin/python" -c 'from awscrt import s3; print(s3.S3RecvFileOption.WRITE_TO_POSITION)' >>"$LOG" 2>&1
}

build() {
    at "looking for a C compiler"
    command -v cc >/dev/null
    at "installing Debian build packages ($BUILD_DEB)"
    sh "$ROOT/scripts/apt-install.sh" $BUILD_DEB >>"$LOG" 2>&1
    tool_venv
    build_wheel
    install_into_venv
}

start=$(date +%s)
set +e
(set -e; build)
rc=$?
set -e
if [ "$rc" = 0 ]; then
    say "awscrt $AWSCRT+recvfile installed in $VENV ($(($(date +%s) - start)) s)"
else
    stock "the build failed while $(grep '^step: ' "$LOG" | tail -n 1 | cut -c16-) (log: ${LOG#"$ROOT"/})"
fi
