# Issue 39's GPU part, third lease: the shipped S3D draft trained on (configs/train/s3d-smollm2-gpu-next.yaml) beside
# the shipped Kangaroo adapter trained on at exits 3 and 4 (configs/train/kangaroo-smollm2-gpu-deeper.yaml), all three
# on the one GPU, each stopped after $1 s of training; after two calls that carried the GGUF's first two parts.
T0=$(date +%s); T=${1:-400}
cp .carry/gguf/part-02 /tmp/ && cat /tmp/part-0* > /tmp/smollm2.gguf || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/gguf-*.whl && export PYTHONPATH=/tmp/site
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > /tmp/gpu.txt; python3 -c "import jax; print(jax.__version__, jax.devices())" >> /tmp/gpu.txt
python3 -m train.s3d --config configs/train/s3d-smollm2-gpu-next.yaml checkpoint=/tmp/smollm2.gguf stop_after_s=$T \
  steps=5000 out=/tmp/s3d > /tmp/s3d.log 2>&1 &
for e in 3 4; do
  python3 -m train.kangaroo --config configs/train/kangaroo-smollm2-gpu-deeper.yaml checkpoint=/tmp/smollm2.gguf \
    exit_layer=$e stop_after_s=$T out=/tmp/k$e > /tmp/k$e.log 2>&1 &
done
wait; echo "trained at $(( $(date +%s) - T0 )) s"
for m in s3d k3 k4; do tail -4 /tmp/$m.log; cp /tmp/$m/draft.npz $OUT/$m-draft.npz; cp /tmp/$m/metrics.jsonl /tmp/$m-metrics.jsonl; done
tar czf $OUT/logs.tar.gz -C /tmp gpu.txt s3d.log k3.log k4.log s3d-metrics.jsonl k3-metrics.jsonl k4-metrics.jsonl
cat /tmp/gpu.txt; ls -la $OUT; echo "done at $(( $(date +%s) - T0 )) s"
