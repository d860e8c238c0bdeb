# session 41 (4x H100), call 3: two parts of each device's batch through the layers side by side
# (--interleave 2), with sluice.ep's exchange on stream 1, so XLA has one part's compute to run
# beside the other's exchange. dsv3-proxy-ep4, 50 steps; rep 1 traces 3 steps from step 30.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus.npz
W=$OUT/s41c; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
one() {  # NAME PROFILE EXTRA [ENV...]
  local name=$1 prof=$2 extra=$3; shift 3
  env "$@" PRESET=dsv3-proxy-ep4 EP=4 STEPS=50 IMPLS=sluice PROFILE=$prof PROFILE_FROM=30 \
    EXTRA="--ep-rows-factor 2 --eval-batches 1 $extra" \
    timeout 110 bash bench/bench_train.sh tgs $W/$name > $W/$name.txt 2>&1
  echo "$name rc=$? $(grep -h '^| sluice' $W/$name/*.md 2>/dev/null)"
  [ "$prof" -gt 0 ] && head -3 $W/$name/profile-sluice.txt | tail -2
}
one base-1 3 ""
one il2-1 3 "--interleave 2"
one il2s1-1 3 "--interleave 2 --ep-stream 1" XLA_FLAGS="--xla_dump_to=$W/hlo --xla_dump_hlo_module_re=.*train_step.*"
one il2s1cap-1 3 "--interleave 2 --ep-stream 1 --ep-sms 32" SLUICE_GMM_SMS=100
one base-2 0 ""
one il2s1-2 0 "--interleave 2 --ep-stream 1"
one il2s1cap-2 0 "--interleave 2 --ep-stream 1 --ep-sms 32" SLUICE_GMM_SMS=100
for f in $W/hlo/*after_optimizations.txt; do python3 bench/hlo_async.py "$f"; done > $W/hlo_async.txt 2>&1
tail -2 $W/hlo_async.txt
for f in $W/hlo/*after_optimizations.txt; do gzip -9 -c "$f" > $W/$(basename "$f").gz; done
rm -rf $W/hlo
find $W -name "*.trace.json.gz" -delete
find $W -name "*.log" -size +2M -delete
find $W -name "hlo.txt" -delete
tar czf $OUT/z.tgz -C $OUT s41c && rm -rf $W
