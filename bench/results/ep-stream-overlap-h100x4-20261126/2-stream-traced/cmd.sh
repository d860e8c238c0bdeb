# session 41 (4x H100), call 2: does anything run beside the exchange once it is on stream 1?
# dsv3-proxy-ep4, 50 steps, 3 steps traced from step 30 (sluice-profile now reports the busy time
# and the op time that overlapped), base / --ep-stream 1 / --ep-stream 1 --ep-sms 32, twice, A B C A B C.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus.npz
W=$OUT/s41b; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
one() {  # NAME EXTRA
  local name=$1 extra=$2
  PRESET=dsv3-proxy-ep4 EP=4 STEPS=50 IMPLS=sluice PROFILE=3 PROFILE_FROM=30 \
    EXTRA="--ep-rows-factor 2 --eval-batches 1 $extra" \
    timeout 150 bash bench/bench_train.sh tgs $W/$name > $W/$name.txt 2>&1
  echo "$name rc=$? $(grep -h '^| sluice' $W/$name/*.md 2>/dev/null)"
  head -3 $W/$name/profile-sluice.txt | tail -2
}
for i in 1 2; do
  one base-$i ""
  one s1-$i "--ep-stream 1"
  one s1sms32-$i "--ep-stream 1 --ep-sms 32"
done
find $W -name "*.trace.json.gz" -delete
find $W -name "*.log" -size +2M -delete
find $W -name "hlo.txt" -delete
tar czf $OUT/z.tgz -C $OUT s41b && rm -rf $W
