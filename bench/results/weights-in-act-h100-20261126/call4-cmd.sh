# session 37, call 4 (2x H100): fan_in(weighted=False)'s backward without the dot (no second scan).
# mid = f10783f (weights in the SwiGLU, the sum's backward by fan_out), new = this tree.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 SLUICE_EP_TIMEOUT=10
export DATA=$PWD/.carry/moe_data/corpus.npz
W=$OUT/w; mkdir -p $W
NEW=$PWD/.carry/new_lib/libsluice.so MID=$PWD/.carry/mid_lib/libsluice.so MIDPY=$PWD/.carry/py_mid/python NEWPY=$PWD/python
( export SLUICE_LIBRARY=$NEW PYTHONPATH=$NEWPY
  timeout 120 python3 tests/gpu/ep_capi_check.py --ranks 2 --transport peer ipc nccl > $W/capi.txt 2>&1; echo "capi rc=$?"; tail -2 $W/capi.txt
  timeout 120 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 python3 tests/gpu/ep_capi_check.py --ranks 1 --quick --transport peer ipc > $W/memcheck.txt 2>&1; echo "memcheck rc=$?"; grep "ERROR SUMMARY" $W/memcheck.txt
  timeout 200 python3 -m pytest -q tests/gpu/test_jax_gpu.py -k "fan or moe or swiglu" > $W/jax-gpu.txt 2>&1; echo "jax rc=$?"; tail -1 $W/jax-gpu.txt )
tgs() {  # TAG SIDE I PRESET EP
  if [ $2 = mid ]; then L=$MID P=$MIDPY; else L=$NEW P=$NEWPY; fi
  d=$W/$1/$2-$3; mkdir -p $d
  EP=$5 DEVICES=$5 SLUICE_LIBRARY=$L PYTHONPATH=$P PRESET=$4 STEPS=10 IMPLS=sluice EXTRA="$([ $5 -gt 1 ] && echo --ep-rows-factor 2) --eval-batches 1" timeout 75 bash bench/bench_train.sh tgs $d > $d.log 2>&1
  echo "$1 $2 $3: $(grep -h '^| sluice' $d/*.md)" | tee -a $W/summary.txt
}
for i in 1 2; do tgs ep2 mid $i dsv3-proxy-ep2 2; tgs ep2 new $i dsv3-proxy-ep2 2; done
for i in 1 2; do tgs one mid $i dsv3-proxy 1; tgs one new $i dsv3-proxy 1; done
find $W -name "*.log" -size +2M -delete
tar czf $OUT/z.tgz -C $OUT w && rm -rf $W
