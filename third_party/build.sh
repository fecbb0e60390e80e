#!/bin/sh
# Install pyfuse3 with FUSE passthrough into the venv VENV (third_party/README.md):
# libfuse 3.17 built from Debian trixie's fuse3 source into VENV/fuse, pyfuse3
# patched (third_party/pyfuse3/passthrough.patch) and built against it with an
# rpath to it. Builds are cached under build/third_party, keyed by the pins below
# and this script and the patch, so a second run only installs.
#
# Usage: third_party/build.sh VENV [passthrough|stock]
# `stock`, or any failure (source unreachable, no compiler, ...): stock pyfuse3
# against the system libfuse, with one line saying why; tierfs then runs without
# passthrough. Where libfuse >= 3.17 is installed system-wide, it is used as is.
set -eu

# -- pins ----------------------------------------------------------------------
FUSE3_DEB=3.17.2-3          # Debian trixie's fuse3 source package (upstream 3.17.2 + Debian's fixes)
FUSE3_DSC_SHA256=1339847e7e6512f31d61cf1fe4598341c4b8aa43ea6dc546914b21f96f29deb3
PYFUSE3=3.5.0
PYFUSE3_SHA256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24
# Build tools, pip-installed into a private build venv (never into VENV).
TOOLS="cython==3.2.4 setuptools==80.9.0 setuptools-scm==8.3.1 meson==1.8.2 ninja==1.11.1.4"
BUILD_DEB="dpkg-dev"        # dpkg-source: unpacks the .dsc and applies Debian's patches

VENV=$(cd "$1" && pwd)
MODE=${2:-passthrough}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
B=$ROOT/build/third_party
PATCH=$HERE/pyfuse3/passthrough.patch
mkdir -p "$B"
LOG=$B/build.log
: >"$LOG"

# Each stage names itself in the log, so a failure says where it stopped.
at() { echo "step: $(date +%T) $*" >>"$LOG"; }
say() { echo "third_party: $*"; }

# Stock pyfuse3 from PyPI against the system's libfuse, saying why once.
stock() {
    say "FUSE passthrough unavailable: $1; installing stock pyfuse3 $PYFUSE3 against the system libfuse $(pkg-config --modversion fuse3 2>/dev/null || echo '?')"
    # A patched 3.5.0+passthrough would satisfy ==3.5.0: remove it and its libfuse first.
    "$VENV/bin/pip" uninstall -q -y pyfuse3 >/dev/null 2>&1 || true
    rm -rf "$VENV/fuse"
    "$VENV/bin/pip" install -q "pyfuse3==$PYFUSE3"
    exit 0
}

[ "$MODE" = stock ] && stock "stock build requested"
[ "$MODE" = passthrough ] || { echo "third_party/build.sh: mode must be passthrough or stock, not '$MODE'" >&2; exit 2; }

# -- libfuse: the system's if >= 3.17, else Debian trixie's source built here ------
apt_private() {
    apt-get -o Dir::Etc::sourcelist=/dev/null -o Dir::Etc::sourceparts="$B/apt/sources" \
        -o Dir::State::Lists="$B/apt/lists" -o Dir::Cache="$B/apt/cache" \
        -o APT::Sandbox::User="$(id -un)" -q "$@"
}

fetch_fuse3() {
    src=$B/src/fuse3-$FUSE3_DEB
    dsc=$B/src/fuse3_$FUSE3_DEB.dsc
    [ -f "$src/.unpacked" ] && return 0
    at "fetching Debian's fuse3 $FUSE3_DEB source (apt deb-src trixie, private apt state)"
    mkdir -p "$B/apt/sources" "$B/apt/lists/partial" "$B/apt/cache/archives/partial" "$B/src"
    cat >"$B/apt/sources/trixie-src.sources" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    # apt verifies the InRelease signature (Debian archive keyring) and every
    # file's hash against the signed Sources index; the .dsc pin below fixes
    # the exact files (it lists their SHA-256s, which dpkg-source checks).
    apt_private update >>"$LOG" 2>&1
    (cd "$B/src" && apt_private source --download-only "fuse3=$FUSE3_DEB") >>"$LOG" 2>&1
    at "verifying fuse3_$FUSE3_DEB.dsc against its pinned SHA-256"
    echo "$FUSE3_DSC_SHA256  $dsc" | sha256sum -c --quiet >>"$LOG" 2>&1
    at "unpacking fuse3 $FUSE3_DEB (dpkg-source)"
    rm -rf "$src"
    dpkg-source -x "$dsc" "$src" >>"$LOG" 2>&1
    touch "$src/.unpacked"
}

# The library only (no fusermount3, mount.fuse3, udev rules or init script),
# staged under $FUSE_STAGE. bindir /usr/bin is only where libfuse looks for
# fusermount3 (non-root mounts): bookworm's setuid one. Nothing is installed there.
build_libfuse() {
    FUSE_STAGE=$B/libfuse-$FUSE3_DEB-$(sha256sum <"$0" | cut -c1-12)
    [ -f "$FUSE_STAGE/.built" ] && return 0
    at "building libfuse $FUSE3_DEB (meson/ninja)"
    rm -rf "$B"/libfuse-* "$B/src/fuse3-$FUSE3_DEB/_build"
    (cd "$B/src/fuse3-$FUSE3_DEB" && export PATH="$TOOLVENV/bin:$PATH" &&
        meson setup _build --prefix="$FUSE_STAGE" --libdir=lib --bindir=/usr/bin \
            --buildtype=release -Duseroot=false -Dinitscriptdir= \
            -Dudevrulesdir="$FUSE_STAGE/lib/udev/rules.d" -Dtests=false -Dutils=false -Dexamples=false &&
        meson install -C _build) >>"$LOG" 2>&1
    touch "$FUSE_STAGE/.built"
}

tool_venv() {
    TOOLVENV=$B/venv-tools
    key=$(echo "$TOOLS" | sha256sum | cut -c1-12)
    [ -f "$TOOLVENV/.tools-$key" ] && return 0
    at "creating the build venv ($TOOLS)"
    rm -rf "$TOOLVENV"
    python3 -m venv "$TOOLVENV" >>"$LOG" 2>&1
    "$TOOLVENV/bin/pip" install -q $TOOLS >>"$LOG" 2>&1
    touch "$TOOLVENV/.tools-$key"
}

# pyfuse3 from its sdist (hash-pinned), patched, the Cython .c regenerated,
# built without isolation (setuptools_scm present: the version is right).
build_pyfuse3() {
    key=$(cat "$0" "$PATCH" | sha256sum | cut -c1-12)
    WHEELS=$B/wheels-$1-$key
    ls "$WHEELS"/pyfuse3-*.whl >/dev/null 2>&1 && return 0
    at "downloading the pyfuse3 $PYFUSE3 sdist (PyPI, hash-pinned)"
    rm -rf "$B/pyfuse3" "$B"/wheels-* && mkdir -p "$B/pyfuse3"
    echo "pyfuse3==$PYFUSE3 --hash=sha256:$PYFUSE3_SHA256" >"$B/pyfuse3/req.txt"
    # pyfuse3's own build tools only: `--no-binary :all:` would build Cython from source.
    "$TOOLVENV/bin/pip" download -q --no-deps --no-binary pyfuse3 --no-build-isolation --require-hashes \
        -r "$B/pyfuse3/req.txt" -d "$B/pyfuse3" >>"$LOG" 2>&1
    at "patching pyfuse3 $PYFUSE3 (third_party/pyfuse3/passthrough.patch)"
    tar xzf "$B/pyfuse3/pyfuse3-$PYFUSE3.tar.gz" -C "$B/pyfuse3"
    sdist=$B/pyfuse3/pyfuse3-$PYFUSE3
    patch -d "$sdist" -p1 --forward --quiet <"$PATCH" >>"$LOG" 2>&1
    rm -f "$sdist/src/pyfuse3/__init__.c"   # regenerated from the patched .pyx
    at "building pyfuse3 $PYFUSE3 with passthrough against libfuse $2"
    mkdir -p "$WHEELS.tmp"
    # $ORIGIN: site-packages/pyfuse3/ -> VENV/fuse/lib, wherever VENV lies.
    (cd "$sdist" && PKG_CONFIG_PATH=$3 LDFLAGS="$4" \
        SETUPTOOLS_SCM_PRETEND_VERSION="$PYFUSE3+passthrough" \
        "$TOOLVENV/bin/pip" wheel -q --no-deps --no-build-isolation -w "$WHEELS.tmp" .) >>"$LOG" 2>&1
    mv "$WHEELS.tmp" "$WHEELS"
}

install_into_venv() {
    at "installing pyfuse3 $PYFUSE3+passthrough into $VENV"
    if [ -n "$1" ]; then
        rm -rf "$VENV/fuse" && mkdir -p "$VENV/fuse/lib"
        cp -P "$1"/lib/libfuse3.so.* "$VENV/fuse/lib/"
    fi
    "$VENV/bin/pip" install -q --force-reinstall --no-deps "$WHEELS"/pyfuse3-*.whl >>"$LOG" 2>&1
    "$VENV/bin/pip" install -q "trio>=0.15" >>"$LOG" 2>&1
    at "checking the installed pyfuse3"
    "$VENV/bin/python" -c 'import pyfuse3; assert pyfuse3.HAVE_PASSTHROUGH; print(pyfuse3.LIBFUSE_VERSION)' >>"$LOG" 2>&1
}

build() {
    at "looking for a C compiler"
    command -v cc >/dev/null
    at "installing Debian build packages ($BUILD_DEB)"
    sh "$ROOT/scripts/apt-install.sh" $BUILD_DEB >>"$LOG" 2>&1
    tool_venv
    if pkg-config --atleast-version=3.17 fuse3 2>/dev/null; then
        sys=$(pkg-config --modversion fuse3)
        build_pyfuse3 "system$sys" "$sys" "" ""
        install_into_venv ""
    else
        fetch_fuse3
        build_libfuse
        build_pyfuse3 "$FUSE3_DEB" "$FUSE3_DEB" "$FUSE_STAGE/lib/pkgconfig" '-Wl,-rpath,$ORIGIN/../../../../fuse/lib'
        install_into_venv "$FUSE_STAGE"
    fi
}

start=$(date +%s)
# A subshell tested by `if` would run with errexit off: take its status instead.
set +e
(set -e; build)
rc=$?
set -e
if [ "$rc" = 0 ]; then
    say "pyfuse3 $PYFUSE3+passthrough on libfuse $(tail -n 1 "$LOG") installed in $VENV ($(($(date +%s) - start)) s)"
else
    stock "the build failed while $(grep '^step: ' "$LOG" | tail -n 1 | cut -c16-) (log: ${LOG#"$ROOT"/})"
fi
