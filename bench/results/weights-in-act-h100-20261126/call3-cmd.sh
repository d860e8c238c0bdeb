# session 37, call 3 (2x H100): where the step's time goes now, one GPU and EP 2 (new tree).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 SLUICE_EP_TIMEOUT=10
export DATA=$PWD/.carry/moe_data/corpus.npz SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
W=$OUT/w; mkdir -p $W
CUDA_VISIBLE_DEVICES=0 PRESET=dsv3-proxy STEPS=10 IMPLS=sluice PROFILE=3 EXTRA="--eval-batches 1" timeout 150 bash bench/bench_train.sh tgs $W/one > $W/one.log 2>&1 &
sleep 5
CUDA_VISIBLE_DEVICES=1 PRESET=dsv3-proxy STEPS=10 IMPLS=dense-cf1.25 PROFILE=3 EXTRA="--eval-batches 1" timeout 150 bash bench/bench_train.sh tgs $W/one-cf > $W/one-cf.log 2>&1
wait
EP=2 DEVICES=2 PRESET=dsv3-proxy-ep2 STEPS=10 IMPLS=sluice PROFILE=3 EXTRA="--ep-rows-factor 2 --eval-batches 1" timeout 170 bash bench/bench_train.sh tgs $W/ep2 > $W/ep2.log 2>&1
head -60 $W/one/profile-sluice.txt; head -40 $W/ep2/profile-sluice.txt
rm -rf $W/*/sluice/profile $W/*/dense-cf1.25/profile
tar czf $OUT/z.tgz -C $OUT w && rm -rf $W
