# session 41 (4x H100): sluice.ep's exchange on XLA GPU stream 1 (setup(stream=1), --ep-stream 1):
# dsv3-proxy-ep4, 50 steps of each variant (base / stream 1 / stream 1 with 32 exchange blocks and
# gmm's grid capped at 100 SMs), the optimized HLO of the stream run (what XLA put between each
# call-start and call-done), and the EP GPU suite with the stream on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus.npz
W=$OUT/s41a; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
one() {  # NAME EXTRA [ENV...]
  local name=$1 extra=$2; shift 2
  env "$@" PRESET=dsv3-proxy-ep4 EP=4 STEPS=50 IMPLS=sluice \
    EXTRA="--ep-rows-factor 2 --eval-batches 1 $extra" \
    timeout 200 bash bench/bench_train.sh tgs $W/$name > $W/$name.txt 2>&1
  echo "$name rc=$? $(grep -h '^| sluice' $W/$name/*.md 2>/dev/null)"
}
one base ""
one s1 "--ep-stream 1" XLA_FLAGS="--xla_dump_to=$W/hlo --xla_dump_hlo_module_re=.*train_step.*"
one s1x "--ep-stream 1 --ep-sms 32" SLUICE_GMM_SMS=100
for f in $W/hlo/*after_optimizations.txt; do
  echo "== $f"; python3 bench/hlo_async.py "$f" | tail -40
done > $W/hlo_async.txt 2>&1
tail -5 $W/hlo_async.txt
grep -h -m20 "call-start\|call-done" $W/hlo/*after_optimizations.txt > $W/hlo_call_lines.txt 2>/dev/null
ls $W/hlo | head -30 > $W/hlo_files.txt
for f in $W/hlo/*after_optimizations.txt; do gzip -9 -c "$f" > $W/$(basename "$f").gz; done
rm -rf $W/hlo
for n in base s1 s1x; do FROM_STEP=20 python3 bench/summarize_train.py tgs $W/$n > $W/$n-from20.txt 2>&1; tail -3 $W/$n-from20.txt; done
find $W -name "*.log" -size +2M -delete
tar czf $OUT/z.tgz -C $OUT s41a && rm -rf $W
