# session 37, call 5 (2x H100): the router's matmul precision: alone, then the one-GPU step with HIGH.
export PYTHONUNBUFFERED=1 DATA=$PWD/.carry/moe_data/corpus.npz SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so
W=$OUT/w; mkdir -p $W
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD/python timeout 120 python3 bench/bench_router.py --md $W/router.md > $W/router.log 2>&1; cat $W/router.md
tgs() {  # SIDE I
  if [ $1 = f32 ]; then P=$PWD/python; else P=$PWD/.carry/py_rh/python; fi
  d=$W/one/$1-$2; mkdir -p $d
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$P PRESET=dsv3-proxy STEPS=10 IMPLS=sluice EXTRA="--eval-batches 1" timeout 75 bash bench/bench_train.sh tgs $d > $d.log 2>&1
  echo "one $1 $2: $(grep -h '^| sluice' $d/*.md)" | tee -a $W/summary.txt
}
for i in 1 2; do tgs f32 $i; tgs high $i; done
find $W -name "*.log" -size +2M -delete
tar czf $OUT/z.tgz -C $OUT w && rm -rf $W
