# Source on the device before any GPU stage:  . tools/lab/device_setup.sh
# The device has no network: the packages its image lacks, or has at other versions (nccl4py, cuda-core,
# cuda-pathfinder, the aiohttp pyproject.toml pins, a setuptools new enough for the license metadata), come as
# wheels in the carried, git-ignored .whl/ (`pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 NAME` here), installed into /tmp/site ahead of the image's; then the project.
for wheel in .whl/*.whl; do  # one at a time: a wheel the device's platform refuses leaves the others installed
  python3 -m pip install -q --no-deps --target /tmp/site "$wheel" 2> /dev/null \
      || { echo "pip refused $wheel (platform tag); unpacked as is"; python3 -m zipfile -e "$wheel" /tmp/site; }
done
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -c "import torch, triton, aiohttp, deltaserve; print('device:', torch.cuda.get_device_name(), 'torch',
torch.__version__, 'triton', triton.__version__, 'aiohttp', aiohttp.__version__)"
python3 -c "import llguidance.torch; print('llguidance imports')" 2>&1 | tail -1; ldd --version | head -1
