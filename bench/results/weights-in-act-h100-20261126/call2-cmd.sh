# session 37, call 2 (2x H100): the JAX GPU suites on the final tree, then EP 2 and one GPU, old / new alternating.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 SLUICE_EP_TIMEOUT=10
export DATA=$PWD/.carry/moe_data/corpus.npz
W=$OUT/w; mkdir -p $W
NEW=$PWD/.carry/new_lib/libsluice.so OLD=$PWD/.carry/scan_lib/libsluice.so OLDPY=$PWD/.carry/py_a/python NEWPY=$PWD/python
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
( export SLUICE_LIBRARY=$NEW PYTHONPATH=$NEWPY
  timeout 230 python3 -m pytest -q tests/gpu/test_jax_gpu.py > $W/jax-gpu.txt 2>&1; echo "jax rc=$?"; tail -1 $W/jax-gpu.txt
  timeout 80 python3 -m pytest -q tests/gpu/test_ep_gpu.py > $W/ep-gpu.txt 2>&1; echo "ep rc=$?"; tail -1 $W/ep-gpu.txt )
tgs() {  # TAG SIDE I PRESET EP
  if [ $2 = old ]; then L=$OLD P=$OLDPY; else L=$NEW P=$NEWPY; fi
  d=$W/$1/$2-$3; mkdir -p $d
  EP=$5 DEVICES=$5 SLUICE_LIBRARY=$L PYTHONPATH=$P PRESET=$4 STEPS=10 IMPLS=sluice EXTRA="$([ $5 -gt 1 ] && echo --ep-rows-factor 2) --eval-batches 1" timeout 75 bash bench/bench_train.sh tgs $d > $d.log 2>&1
  echo "$1 $2 $3: $(grep -h '^| sluice' $d/*.md)" | tee -a $W/summary.txt
}
for i in 1 2; do tgs ep2 old $i dsv3-proxy-ep2 2; tgs ep2 new $i dsv3-proxy-ep2 2; done
for i in 1 2; do tgs one old $i dsv3-proxy 1; tgs one new $i dsv3-proxy 1; done
find $W -name "*.log" -size +2M -delete
tar czf $OUT/z.tgz -C $OUT w && rm -rf $W
