# Issue 39's kept-layers lever, fifth lease: four S3D drafts trained from scratch side by side, one per skip plan,
# each stopped after $1 s of training; after two calls that carried the GGUF's first two parts.
T0=$(date +%s); T=${1:-290}; D=train/distilled/smollm2-sharegpt-10k
cp .carry/gguf/part-02 /tmp/ && cat /tmp/part-0* > /tmp/smollm2.gguf || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/gguf-*.whl && export PYTHONPATH=/tmp/site
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > /tmp/gpu.txt
python3 -c "import jax; print(jax.__version__, jax.devices())" >> /tmp/gpu.txt
python3 -m train.distill --out $D --prompts 14080 --new-tokens 256 --max-prompt 192 --part-rows 256 \
  --eval-fraction 0.05 --sort part --checkpoint /tmp/smollm2.gguf > /tmp/shards.log 2>&1 || { tail -5 /tmp/shards.log; exit 1; }
echo "shards at $(( $(date +%s) - T0 )) s"
for s in 8-21 10-19 12-17 14-15; do
  python3 -m train.s3d --config configs/train/s3d-smollm2-gpu-beta.yaml checkpoint=/tmp/smollm2.gguf stop_after_s=$T \
    skip=$s out=/tmp/b$s > /tmp/b$s.log 2>&1 &
done
wait; echo "trained at $(( $(date +%s) - T0 )) s"
for s in 8-21 10-19 12-17 14-15; do
  tail -3 /tmp/b$s.log; cp /tmp/b$s/metrics.jsonl /tmp/b$s-metrics.jsonl; cp /tmp/b$s/draft.npz $OUT/b$s-draft.npz
done
tar czf $OUT/logs.tar.gz -C /tmp gpu.txt shards.log b8-21.log b10-19.log b12-17.log b14-15.log \
  b8-21-metrics.jsonl b10-19-metrics.jsonl b12-17-metrics.jsonl b14-15-metrics.jsonl
cat /tmp/gpu.txt; ls -la $OUT; echo "done at $(( $(date +%s) - T0 )) s"
