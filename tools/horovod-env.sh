#!/usr/bin/env bash
# Builds an environment with Horovod: bash tools/horovod-env.sh VENV PYTHON [LANE].
#
# LANE names the pinned requirements (requirements/LANE.txt and LANE-no-deps.txt):
#   horovod  (make venv-horovod, .venv-horovod) TensorFlow 2.18.1 (the newest that Horovod 0.28.1
#            builds against unpatched), its Keras 3, tf_keras 2.18 (Keras 2) and PyTorch 2.13
#            (CPU); Horovod compiled for both frameworks.
#   tf215    (by hand, into .venv-tf215) the TensorFlow 2.15 lane with Horovod: TensorFlow 2.15.1,
#            whose tf.keras is the keras 2.15 package (Keras 2, no Keras 3), tf_keras 2.15,
#            numpy < 2; Horovod compiled for TensorFlow only. `make venv-tf215` builds that lane
#            without Horovod (CI's time); CONTRIBUTING.md has the command that runs the Horovod
#            tests there.
# Horovod 0.28.1 is compiled from source with Gloo and MPI (Debian's Open MPI), and tfdist is
# installed editable. The compiled wheel is cached under a key holding the Horovod, TensorFlow,
# torch and Python versions and the controllers, because pip's own cache keys it by the sdist
# alone and would hand back a wheel compiled against another TensorFlow.
# Cache folder: $TFDIST_WHEEL_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/tfdist/wheels.
#
# Horovod 0.28.1 compiles its torch extension and its bundled gloo as C++14, where torch 2's
# headers need C++17; the torch extension links that gloo, so both move to C++17 together
# (with the torch line alone the link fails on gloo::rendezvous::Store::kDefaultTimeout, defined
# inline in C++17 and out of line in C++14). TensorFlow's extension is C++17 already and links
# its own gloo, so it is unchanged. Upstream still has the C++14 lines.
set -euo pipefail

HOROVOD_VERSION=0.28.1
venv=${1:-.venv-horovod}
python=${2:-python3}
lane=${3:-horovod}
case $lane in
    horovod) torch=1 ;;
    tf215) torch=0 ;;
    *) echo "tools/horovod-env.sh: unknown lane '$lane' (horovod or tf215)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
root=$PWD
[[ $venv == /* ]] || venv=$root/$venv
bin=$venv/bin
# Horovod's build calls `cmake` from PATH: the pinned cmake<4 (bundled gloo needs it) comes first.
export PATH=$bin:$PATH
quiet=(--quiet --disable-pip-version-check)

log() { echo "tools/horovod-env.sh: $*" >&2; }

make_venv() {
    test -x "$bin/python" || "$python" -m venv "$venv"
    "$bin/python" -m pip install "${quiet[@]}" -r requirements/bootstrap.txt
    "$bin/pip" install "${quiet[@]}" -r "requirements/$lane.txt"
    "$bin/pip" install "${quiet[@]}" --no-deps -r "requirements/$lane-no-deps.txt"
    if ((torch)); then
        "$bin/pip" install "${quiet[@]}" --no-deps -r requirements/torch.txt
    fi
}

# Gloo always; MPI when Open MPI's compiler wrapper is there (tools/system-packages.sh).
controllers() {
    if command -v mpicxx >/dev/null; then echo gloo-mpi; else echo gloo; fi
}

cache_dir() {
    local tf frameworks py
    tf=$("$bin/python" -c 'import importlib.metadata as m; print(m.version("tensorflow-cpu"))')
    frameworks=tf$tf
    if ((torch)); then
        frameworks+=-torch$("$bin/python" -c \
            'import importlib.metadata as m; print(m.version("torch").split("+")[0])')
    fi
    py=$("$bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    local base=${TFDIST_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tfdist/wheels}
    echo "$base/horovod-$HOROVOD_VERSION-$frameworks-$py-$(controllers)"
}

# C++17 for the torch extension and the gloo it links (see the header); fails if the sdist's
# lines changed.
patch_cxx17() {
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$1/CMakeLists.txt" "$1/horovod/torch/CMakeLists.txt"
    grep -q 'set(CMAKE_CXX_STANDARD 17)' "$1/CMakeLists.txt"
    grep -q 'set(CMAKE_CXX_STANDARD 17)' "$1/horovod/torch/CMakeLists.txt"
}

# Release (-O3) instead of RelWithDebInfo (-O3 -g): the wheel's libraries are stripped of the
# debug info anyway (finish_wheel), and compiling it cost a minute of CI's 40 (this script with
# a warm pip cache, on 2 cores: 319 s against 257 s). Horovod's setup.py has no switch for the
# build type; fails if its line changed.
patch_release() {
    sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$1/setup.py"
    grep -q "else 'Release'" "$1/setup.py"
}

# Compiles the wheel into $1.
build_wheel() {
    local out=$1 work
    work=$(mktemp -d)
    local mpi=HOROVOD_WITHOUT_MPI=1 pytorch=HOROVOD_WITHOUT_PYTORCH=1 what=TensorFlow
    [[ $(controllers) == gloo-mpi ]] && mpi=HOROVOD_WITH_MPI=1
    ((torch)) && pytorch=HOROVOD_WITH_PYTORCH=1 what="TensorFlow and PyTorch"
    log "compiling horovod $HOROVOD_VERSION for $what ($(controllers)); this takes 5 to 12" \
        "minutes on 2 cores"
    "$bin/pip" download "${quiet[@]}" --no-binary :all: --no-deps "horovod==$HOROVOD_VERSION" \
        -d "$work/sdist"
    tar xzf "$work/sdist/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    patch_release "$work/horovod-$HOROVOD_VERSION"
    if ((torch)); then
        patch_cxx17 "$work/horovod-$HOROVOD_VERSION"
    fi
    env HOROVOD_WITH_TENSORFLOW=1 "$pytorch" HOROVOD_WITH_GLOO=1 "$mpi" \
        HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
        "$bin/pip" wheel "${quiet[@]}" --no-deps --no-build-isolation --no-cache-dir \
        "$work/horovod-$HOROVOD_VERSION" -w "$work/raw"
    finish_wheel "$work"/raw/horovod-*.whl "$out"
    rm -rf "$work"
}

# Strips the debug info from the wheel's libraries (~55 MB -> ~2 MB each) and moves it into the
# cache folder $2 (atomically: a half-written wheel is never taken from the cache).
finish_wheel() {
    local raw=$1 out=$2 work
    work=$(mktemp -d)
    "$bin/python" -m wheel unpack "$raw" -d "$work/unpacked" >/dev/null
    find "$work/unpacked" -name '*.so' -exec strip --strip-debug {} +
    mkdir -p "$work/stripped" "$out"
    "$bin/python" -m wheel pack "$work"/unpacked/horovod-* -d "$work/stripped" >/dev/null
    local wheel
    wheel=$(basename "$(compgen -G "$work/stripped/horovod-*.whl")")
    mv "$work/stripped/$wheel" "$out/.$wheel.partial"
    mv "$out/.$wheel.partial" "$out/$wheel"
    rm -rf "$work"
}

install_horovod() {
    local dir
    dir=$(cache_dir)
    if ! compgen -G "$dir/horovod-*.whl" >/dev/null; then
        build_wheel "$dir"
    else
        log "using the cached wheel in $dir"
    fi
    "$bin/pip" install "${quiet[@]}" --no-deps --force-reinstall "$dir"/horovod-*.whl
}

verify() {
    TF_CPP_MIN_LOG_LEVEL=2 "$bin/horovodrun" --check-build
    TF_CPP_MIN_LOG_LEVEL=2 "$bin/python" - "$(controllers)" "$torch" <<'EOF'
import importlib.metadata
import sys

import horovod.tensorflow as hvd
import tensorflow as tf

assert hvd.gloo_built(), "horovod was built without Gloo"
if sys.argv[1] == "gloo-mpi":
    assert hvd.mpi_built(), "horovod was built without MPI"
built = f"TensorFlow {tf.__version__}"
if sys.argv[2] == "1":
    import horovod.torch  # noqa: F401
    import torch
    built += f" and torch {torch.__version__}"
print(f"horovod {importlib.metadata.version('horovod')} built for {built}: "
      f"gloo={hvd.gloo_built()} mpi={hvd.mpi_built()}")
EOF
}

make_venv
install_horovod
# The editable install writes tfdist.egg-info in the checkout: one at a time (make builds the
# environments at once).
flock "$root/.editable.lock" "$bin/pip" install "${quiet[@]}" --no-deps --no-build-isolation -e .
verify
touch "$venv/.tfdist-installed"
log "ready: $venv"
