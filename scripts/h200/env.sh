# source scripts/h200/env.sh  (on the device, from the repository root, after setup.sh ran once)
# The working tree's sources come first; /tmp/site holds third-party wheels and the workspace's
# own wheels (only for their entry points: the code imported is the source tree's).
export PYTHONPATH=$(ls -d "$PWD"/kernel/src "$PWD"/contracts/src "$PWD"/packages/*/src "$PWD"/plugins/*/src | paste -sd:):/tmp/site
export PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MILES_HOME=/tmp/mh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
