#!/bin/sh
# install-cpu-torch.sh REQUIREMENTS WHEEL_DIR INDEX: inside a Docker build, installs the torch that
# REQUIREMENTS pins (a +cpu build: PyPI does not carry it). From WHEEL_DIR when that folder holds
# a wheel of it, else from the extra index INDEX (PyPI stays the main index: torch's own
# dependencies come from there). When neither is given, or neither has it, the build stops with
# a message saying which torch it looked for, where, and how to hand it in.
set -eu
req=$1 wheels=$2 index=$3
pin=$(sed -n 's/^\(torch==[^ ;#]*\).*/\1/p' "$req")
if [ -z "$pin" ]; then
  echo "install-cpu-torch: $req has no torch== line" >&2
  exit 1
fi
version=${pin#torch==}
python=$(python -c 'import sys; print("cp%d%d" % sys.version_info[:2])')

if ls "$wheels/torch-$version-"*.whl >/dev/null 2>&1; then
  where="the wheel folder CPU_TORCH_WHEELS ($(cd "$wheels" && echo "torch-$version-"*.whl))"
  set -- --find-links "$wheels"
elif [ -n "$index" ]; then
  where="the index CPU_TORCH_INDEX=$index"
  set -- --extra-index-url "$index"
else
  where="nowhere: CPU_TORCH_WHEELS holds no torch-$version wheel and CPU_TORCH_INDEX is empty"
  set --
fi
echo "install-cpu-torch: $pin for $python from $where"
if [ $# = 0 ] || ! pip-install "$@" "$pin"; then
  cat >&2 <<MSG
install-cpu-torch: cannot install $pin (for this image's Python, $python) from $where.
This torch is not on PyPI. Hand it in to the build one of two ways:
  make image DEVICE=cpu CPU_TORCH_WHEELS=DIR   a folder holding torch-$version-$python-*.whl
  make image DEVICE=cpu CPU_TORCH_INDEX=URL    an index that has it (default: the PyTorch CPU index)
(docker build: --build-arg CPU_TORCH_WHEELS=IMAGE, an image holding the wheel at its root, or
--build-arg CPU_TORCH_INDEX=URL.)
MSG
  exit 1
fi
python -c "import sys, torch; v = torch.__version__; sys.exit(0 if v == '$version' else 'install-cpu-torch: installed torch ' + v + ', not $version')"
