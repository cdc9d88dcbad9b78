# Sourced by the GPU scripts: the project's packages for the host's Python (from .whl/
# where that folder exists, else from the package index) into a folder of their own on
# PYTHONPATH, and ``build_here DIR``, which builds a tree's C extensions in place.
#
# Needs python3 (or $PYTHON) with a CUDA build of torch, setuptools, a C compiler and
# OpenSSL's headers (CFLAGS and LDFLAGS reach the compiler).
py="${PYTHON:-python3}"
site=/tmp/kvsidecar-site
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
else
  "$py" -m pip install -q --target "$site" $(benchmarks/gpu_wheels.sh --list)
fi

# xxHash's header, where the host has none: unpacked here beforehand with
#   apt-get download libxxhash-dev && dpkg -x libxxhash-dev_*.deb .deps/xxhash
if [ -d .deps/xxhash/usr/include ]; then
  export CFLAGS="-I$PWD/.deps/xxhash/usr/include ${CFLAGS:-}"
fi

build_here() {  # DIR LOG: the tree's C extensions, built in place for this Python
  if ! (cd "$1" && "$py" -c 'from setuptools import setup; setup()' build_ext --inplace -q) \
      >"$2" 2>&1; then
    tail -40 "$2"
    return 1
  fi
}
