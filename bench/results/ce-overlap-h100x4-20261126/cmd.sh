# session 41 (4x H100), call 6: copy engines beside a GEMM (dev/probe/ce_overlap.py): 1 and 3 peers.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT/s41f; mkdir -p $W
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c "import torch; print('torch', torch.__version__)"; date -u; } > $W/machine.txt 2>&1
for p in 1 3; do timeout 120 python3 dev/probe/ce_overlap.py --peers $p --mib 64 --reps 40; done 2>&1 | tee $W/ce_overlap.txt
tar czf $OUT/z.tgz -C $OUT s41f && rm -rf $W
