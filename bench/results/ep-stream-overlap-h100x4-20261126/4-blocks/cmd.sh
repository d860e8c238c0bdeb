# session 41 (4x H100), call 4: --interleave 2 --ep-stream 1 with fewer exchange blocks (16, 8) and
# gmm on every SM, against the base; dsv3-proxy-ep4, 50 steps, A B C A B C, no traces.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus.npz
W=$OUT/s41d; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
one() {  # NAME EXTRA
  local name=$1 extra=$2
  PRESET=dsv3-proxy-ep4 EP=4 STEPS=50 IMPLS=sluice EXTRA="--ep-rows-factor 2 --eval-batches 1 $extra" \
    timeout 100 bash bench/bench_train.sh tgs $W/$name > $W/$name.txt 2>&1
  echo "$name rc=$? $(grep -h '^| sluice' $W/$name/*.md 2>/dev/null)"
}
for i in 1 2; do
  one base-$i ""
  one il2s1sms16-$i "--interleave 2 --ep-stream 1 --ep-sms 16"
  one il2s1sms8-$i "--interleave 2 --ep-stream 1 --ep-sms 8"
done
find $W -name "*.log" -size +2M -delete
tar czf $OUT/z.tgz -C $OUT s41d && rm -rf $W
